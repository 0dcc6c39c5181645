"""Structured output: a request's ``StructuredOutput`` (JSON schema, JSON object, regex, choice, grammar) compiled
by llguidance into a token matcher, and the allowed-token bitmask of each step.

Why llguidance (measured on SmolLM2's 49,152-token vocabulary, this module's first machine): it fails closed —
a JSON Schema keyword it cannot enforce is an error ("Unimplemented keys"), never dropped —, compiles a schema in
~1-4 ms, computes a mask in ~0.05-0.5 ms with the GIL released, bounds its own work per compile and per mask
(``LLParserLimits``: lexer fuel, Earley items, grammar size), and needs no torch. xgrammar silently ignores
part of what it does not support (multi-branch ``allOf``), which this engine must refuse.

Where the mask goes: a greedy stream's bitmask travels in the MASKS record right behind its step op
(``WANT_ALLOWED``: vocab / 8 bytes, 6 KB for SmolLM2, instead of shipping 192 KB of fp32 logits back), computed
on the dispatcher thread while the stages run the op, and the last stage takes the argmax among allowed tokens; a
stream whose logits come back anyway (sampling, logit_bias, penalties) is masked by the coordinator
(``ringshm.engine.sampling.Sampler``). Either way the mask depends only on the stream's own tokens, so batch
invariance holds: a constrained stream's bytes do not depend on its batch-mates.

The tokenizer's tables are built once per engine (~1 s); compiled grammars are cached by the spec's canonical
text (the tokenizer is the engine's own, so it is part of the cache's identity by construction).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import torch

from ringshm.errors import InvalidParameter
from ringshm.generation_params import StructuredOutput

# JSON whitespace between tokens: at most this many characters per gap (llguidance's default is unbounded, and
# small models can emit spaces until max_tokens; pretty-printed JSON at depth 7 with 4-space indents needs 29).
MAX_JSON_WHITESPACE = 32
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{1,{MAX_JSON_WHITESPACE}}}"}
COMPILE_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
MAX_ERROR_CHARS = 600  # of llguidance's error text in a message (it may quote the whole grammar)
COMPILE_TIMEOUT_S = 5.0  # a compile (with its first mask) running longer is refused (``GrammarCompiler.compile``)
MAX_STUCK_COMPILES = 2  # compile threads left running past the limit before every compile is refused


def _short(error: str) -> str:
    """llguidance's error text without the parser dump it appends after "<state>", cut to ``MAX_ERROR_CHARS`` (a
    400 or a log line never echoes a whole grammar)."""
    error = error.split("\n<state>", 1)[0].strip()
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + f" ... ({len(error)} characters)"


def _pointer(schema, keys: set[str], path: str = "") -> str | None:
    """The JSON pointer of the first object in ``schema`` (depth first) that holds one of ``keys`` as a keyword,
    or None. ``properties`` / ``$defs`` maps are walked as maps (their keys are names, not keywords)."""
    if isinstance(schema, dict):
        hit = next((k for k in schema if k in keys), None)
        if hit is not None:
            return f"{path}/{hit}"
        for k, v in schema.items():
            sub = f"{path}/{k.replace('~', '~0').replace('/', '~1')}"
            if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(
                    v, dict):
                for name, inner in v.items():
                    found = _pointer(inner, keys, f"{sub}/{name.replace('~', '~0').replace('/', '~1')}")
                    if found:
                        return found
            else:
                found = _pointer(v, keys, sub)
                if found:
                    return found
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            found = _pointer(v, keys, f"{path}/{i}")
            if found:
                return found
    return None


def _explain(spec: StructuredOutput, error: str) -> str:
    """llguidance's compile error (cut: ``_short``), with the JSON pointer of an unimplemented keyword named."""
    error = _short(error)
    if spec.kind == "json_schema" and error.startswith("Unimplemented keys"):
        try:
            keys = set(json.loads(error.split(":", 1)[1]))
        except (ValueError, IndexError):
            keys = set()
        where = _pointer(spec.spec, keys) if keys else None
        if where is not None:
            return (f"the JSON schema uses a keyword the grammar engine cannot enforce (it is refused, not "
                    f"ignored): {error} at {where}")
    return f"the {spec.kind.replace('_', ' ')} does not compile: {error}"


class GrammarCompiler:
    """One engine's grammar compiler: the llguidance tokenizer of the engine's tokenizer, built once on first
    use, and the compiled grammars by spec.

    Args:
        tokenizer: the engine's transformers fast tokenizer.
        vocab: the model's vocabulary size (its LM head's rows; may exceed the tokenizer's: ids past the
            tokenizer are never allowed).
        eos_ids: the model's EOS ids (allowed where the grammar accepts).
    """

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self._hf, self.vocab, self.eos_ids = tokenizer, int(vocab), sorted(int(t) for t in eos_ids)
        self._llt = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()  # spec key -> pristine LLMatcher
        self._refused: dict[str, str] = {}  # spec key -> why (compiles that ran over the time limit)
        self.n_stuck = 0  # compile threads still running past the limit
        self.mask_totals = [0.0, 0]  # seconds computing masks and masks computed, over every stream
        self.n_compiled = self.n_cache_hits = 0
        self.compile_s: list[float] = []  # each compile's time (the server's histogram reads and clears it)

    @property
    def tokenizer(self):
        """llguidance's ``LLTokenizer`` (built on first use: ~1 s for a 50k vocabulary)."""
        with self._lock:
            if self._llt is None:
                import llguidance.hf

                self._llt = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab,
                                                         eos_token=self.eos_ids or None)
            return self._llt

    def compile(self, spec: StructuredOutput):
        """The pristine llguidance matcher of ``spec``, built once and cached by ``spec.key()`` (streams take
        copies: ``state``), with its first mask computed once on a copy to prove it. Builds the tokenizer's tables
        on first use. Thread-safe; the server calls it off its event loop (llguidance drops the GIL).

        The build runs on a thread of its own and is given ``COMPILE_TIMEOUT_S``: llguidance's limits bound most
        grammars, not all (``start: X X "b"`` with ``X: "a"+`` computes its first mask forever). One that runs
        over is refused (its spec remembered, so asking again is refused at once); its thread cannot be stopped,
        so after ``MAX_STUCK_COMPILES`` of them every compile is refused until the engine restarts.

        Raises:
            InvalidParameter (param "structured_output"): a schema that is not a valid JSON Schema (the
                ``jsonschema`` meta-schema check, with where), a keyword the engine cannot enforce (named, with
                its JSON pointer), a regex or grammar that does not parse, one over llguidance's limits or nested
                too deep, one whose first mask fails or allows nothing, or one over the time limit.
        """
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.n_cache_hits += 1
                return self._cache[key]
            if key in self._refused:
                raise InvalidParameter(self._refused[key], "structured_output")
            if self.n_stuck >= MAX_STUCK_COMPILES:
                raise InvalidParameter(f"structured output is unavailable: {self.n_stuck} earlier grammars never "
                                       f"finished compiling (restart the engine)", "structured_output")
        t0 = time.perf_counter()
        out: dict = {}

        def build():
            try:
                out["matcher"] = self._build(spec)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                out["error"] = exc

        worker = threading.Thread(target=build, name="ringshm-grammar-compile", daemon=True)
        worker.start()
        worker.join(COMPILE_TIMEOUT_S)
        if worker.is_alive():
            why = (f"the {spec.kind.replace('_', ' ')} takes more than {COMPILE_TIMEOUT_S:g} s to compile and "
                   f"compute its first mask: simplify it")
            with self._lock:
                self.n_stuck += 1
                self._refused[key] = why
            raise InvalidParameter(why, "structured_output")
        if "error" in out:
            raise out["error"]
        matcher = out["matcher"]
        with self._lock:
            self.n_compiled += 1
            self.compile_s.append(time.perf_counter() - t0)
            self._cache[key] = matcher
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def _build(self, spec: StructuredOutput):
        """``compile``'s work: the grammar, checked, its matcher, and its first mask on a copy."""
        from llguidance import LLMatcher, grammar_from

        try:
            if spec.kind == "json_schema":
                _check_schema(spec.spec)
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.spec if spec.kind == "json_schema" else {"type": "object"}
                grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            elif spec.kind == "choice":
                grammar = grammar_from("choice", list(spec.spec))
            else:
                grammar = grammar_from("grammar" if spec.kind == "grammar" else "regex", spec.spec)
        except RecursionError:
            raise InvalidParameter(f"the {spec.kind.replace('_', ' ')} is nested too deeply to check",
                                   "structured_output") from None
        except ValueError as exc:  # llguidance's converters (GBNF -> Lark, JSON text)
            if isinstance(exc, InvalidParameter):
                raise
            raise InvalidParameter(_explain(spec, str(exc)), "structured_output") from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)  # one compile: its error is validate's own text
        if matcher.is_error():
            raise InvalidParameter(_explain(spec, matcher.get_error() or "unknown error"), "structured_output")
        probe = GrammarState(matcher.deep_copy(), self.vocab)
        try:
            probe.words()
        except InvalidParameter as exc:
            raise InvalidParameter(_explain(spec, str(exc).split(": ", 1)[-1]), "structured_output") from None
        return matcher

    def state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh ``GrammarState`` for one stream under ``spec`` (a copy of the cached matcher). Raises as
        ``compile``."""
        matcher = self.compile(spec)
        with self._lock:
            copy = matcher.deep_copy()
        return GrammarState(copy, self.vocab, self.mask_totals)


def _check_schema(schema) -> None:
    """Raise InvalidParameter unless ``schema`` is a valid JSON Schema of the draft it names (2020-12 when none),
    saying what and where."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path) if exc.absolute_path else "the root"
        raise InvalidParameter(f"the JSON schema is not valid ({cls.__name__[:-9]}): {exc.message} at {where}",
                               "structured_output") from None


class GrammarState:
    """One stream's place in its grammar: the allowed-token bitmask of its next position and the tokens it has
    taken. Used by the dispatcher thread only.

    ``words()``: int32 ``[ceil(vocab / 32)]`` (token t allowed iff bit t % 32 of word t // 32 is set), computed
    once per position. ``accept(token)`` moves on; ``stopped``: the grammar is complete (nothing but EOS fits).
    """

    def __init__(self, matcher, vocab: int, totals: list | None = None):
        self.matcher, self.vocab = matcher, vocab
        self._words: torch.Tensor | None = None
        self.mask_s = 0.0  # time spent computing masks (seconds)
        self.totals = totals  # the compiler's [mask seconds, masks] over every stream (its metrics), or None

    def words(self) -> torch.Tensor:
        """The next position's bitmask, int32 ``[ceil(vocab / 32)]`` (computed on first call per position).

        Raises:
            InvalidParameter: no token is allowed (the grammar cannot go on: llguidance's error named).
        """
        if self._words is None:
            t0 = time.perf_counter()
            words = torch.zeros(-(-self.vocab // 32), dtype=torch.int32)
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            self._count(time.perf_counter() - t0)
            self._take(words)
        return self._words

    def _count(self, seconds: float) -> None:
        self.mask_s += seconds
        if self.totals is not None:
            self.totals[0] += seconds
            self.totals[1] += 1

    def _take(self, words: torch.Tensor) -> None:
        """Keep ``words`` as the next position's bitmask. Raises InvalidParameter when it allows none or the
        matcher is in error."""
        if self.matcher.is_error() or not bool(words.any()):
            why = _short(self.matcher.get_error()) or "no token is allowed here"
            raise InvalidParameter(f"the structured output cannot go on: {why}", "structured_output")
        self._words = words

    def draft_masks(self, drafts: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """For a speculative verify of ``[last token, *drafts]``: the drafts cut before the first one the grammar
        refuses (``validate_tokens``: a draft past the grammar's end included), and the bitmask of each position the
        verify decides (the next position's, then the one after each kept draft), all computed from a walk the
        matcher rolls back, so its state is unchanged.

        Raises:
            InvalidParameter, RuntimeError: as ``words`` and ``accept`` (the matcher is rolled back first).
        """
        first = self.words()
        kept = list(drafts[:self.matcher.validate_tokens(list(drafts))]) if drafts else []
        masks, walked = [first], 0
        try:
            for token in kept:
                if not self.matcher.consume_token(int(token)):  # validate_tokens said it fits: never here
                    why = _short(self.matcher.get_error())
                    raise RuntimeError(f"draft token {token} does not fit the grammar: {why}")
                walked += 1
                self._words = None
                masks.append(self.words())
        finally:
            self.matcher.rollback(walked)
            self._words = first
        return kept, masks

    def allowed(self) -> torch.Tensor:
        """The next position's allowed tokens as bool ``[vocab]``."""
        from ringshm.model.head import unpack_bitmask

        return unpack_bitmask(self.words()[None], self.vocab)[0]

    def accept(self, token: int) -> None:
        """Take ``token`` as the stream's next.

        Raises:
            RuntimeError: the grammar refuses it (a token chosen outside the mask: a bug, never a user error).
        """
        self._words = None
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"token {token} does not fit the structured output: {_short(self.matcher.get_error())}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete: no token but EOS can follow."""
        return self.matcher.is_stopped()
