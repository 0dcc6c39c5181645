"""Bytes between processes and hosts: shared-memory segments, the SPSC ``Ring``, every op and its record codec
(``messages``), the edges and bridges that carry ring records between hosts, and the rendezvous.
May import: the base modules (errors, config, generation_params, version, ``_C``) and this folder."""
