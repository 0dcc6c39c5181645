"""A head (node 0) in its own process tree, for tests that kill it: starts a 2-node engine, prints "ready",
then decodes until it is killed. Usage: python _multihost_head.py PORT"""

import sys

from ringshm.engine.engine import Engine

if __name__ == "__main__":
    port = int(sys.argv[1])
    with Engine(stages=2, nnodes=2, master_port=port, max_rows=2, max_seq_len=512, prefill_chunk=64,
                progress=False, edge_timeout_s=2.0) as engine:
        print("ready", flush=True)
        while True:
            for _ in engine.stream("Count slowly from one to a thousand:", max_new_tokens=400):
                pass
