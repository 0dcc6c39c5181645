"""What one request asks for: ``GenerationParams`` (sampling, stops, logprobs, speculation) and the limits and
checks its fields share with the server's request bodies (``check_temperature``, ``check_stop``,
``check_logit_bias``, ...). A base module: it imports nothing of ringshm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SPEC_METHODS = (None, "ngram")
MAX_TOP_LOGPROBS = 20  # the most top-k entries per position: OpenAI's chat top_logprobs limit (vLLM's default cap)
MAX_SPEC_K = 16  # most draft tokens per verify segment (it bounds a step op's size, EngineConfig.max_op_tokens)

# Sampling values whose arithmetic fp32 carries out. The sampler divides fp32 logits by the temperature and by the
# repetition penalty: a divisor under fp32's range (1e-300 is 0 there) turns logits into inf / NaN. Logits of
# real models stay far below 1e4, so with these limits every processed logit stays finite.
MIN_TEMPERATURE = 1e-2  # a temperature in (0, 1e-2) samples at 1e-2 (vLLM's rule, SamplingParams' _MAX_TEMP)
MAX_TEMPERATURE = 100.0  # above it a step's distribution is uniform to fp32 precision anyway
REPETITION_PENALTY_RANGE = (1e-2, 1e2)  # HF / vLLM use 1 .. 2; 1e-2 .. 1e2 keeps logit / r and logit * r finite
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; stream i of a batch uses seed + i
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema (as JSON text), regex or grammar; bounds what one request brings to compile
MAX_CHOICES = 1000  # strings of a ``choice`` (llguidance's parser holds at most 2,000 items in a row)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text (structured output), enforced token by token by the grammar
    engine (``ringshm.engine.grammar``, llguidance).

    ``kind`` and ``spec``:

    - ``"json_schema"``: ``spec`` a JSON Schema (a dict, or its JSON text); the output is one JSON value that
      validates against it. A keyword the engine cannot enforce is refused by name, never ignored.
    - ``"json_object"``: ``spec`` None; the output is one JSON object (OpenAI's JSON mode).
    - ``"regex"``: ``spec`` a regular expression (Rust ``regex`` syntax) the whole output matches.
    - ``"choice"``: ``spec`` a list of strings; the output is exactly one of them.
    - ``"grammar"``: ``spec`` a context-free grammar: Lark (llguidance's dialect), or GBNF (llama.cpp's,
      recognised by its ``::=``).

    Raises:
        ValueError: an unknown kind, or a spec of the wrong type, empty, or over ``MAX_GRAMMAR_CHARS``
            characters (``MAX_CHOICES`` strings for a choice). Whether the spec compiles is the engine's check
            (``ringshm.engine.grammar.GrammarCompiler``), before anything is sent.
    """

    kind: str
    spec: object = None

    def __post_init__(self) -> None:
        import json

        kind, spec = self.kind, self.spec
        if kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {shown(kind)}")
        if kind == "json_object":
            if spec is not None:
                raise ValueError("a json_object structured output takes no spec (give kind 'json_schema' for a schema)")
            return
        if kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(spec, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object (or true / false), got {type(spec).__name__}")
            text = json.dumps(spec, sort_keys=True)
        elif kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ValueError("a choice must be a non-empty list of non-empty strings")
            if len(spec) > MAX_CHOICES:
                raise ValueError(f"a choice holds {len(spec)} strings; at most {MAX_CHOICES} are allowed")
            spec = tuple(spec)
            text = json.dumps(spec)
        else:
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"a {kind} must be a non-empty string, got {shown(spec)}")
            text = spec
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {kind.replace('_', ' ')} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} "
                             f"are allowed")
        object.__setattr__(self, "spec", spec)

    def key(self) -> str:
        """The spec as canonical text (a schema's keys sorted): equal constraints, equal keys (the compile cache's)."""
        import json

        return json.dumps([self.kind, self.spec], sort_keys=True)


class KeywordsNamed:
    """Base of a dataclass taken as keyword arguments (``GenerationParams``, ``EngineConfig``): a name it does not
    take raises a TypeError that names it, the closest field and where the fields are documented, before the
    dataclass's own "__init__() got an unexpected keyword argument" (which names an internal class)."""

    def __new__(cls, *args, **kwargs):
        import dataclasses
        import difflib

        names = [f.name for f in dataclasses.fields(cls) if f.init]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unknown keyword argument {name!r}{hint}: the settings are {cls.__name__}'s fields, "
                                f"ringshm.{cls.__name__} documents them")
        return super().__new__(cls)


@dataclass(frozen=True)
class GenerationParams(KeywordsNamed):
    """How to generate for one request (``Engine.generate`` and friends take these as keyword arguments).

    Args:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (default); > 0 samples, with ``top_k`` (0: no cut) and ``top_p`` (nucleus). At
            most ``MAX_TEMPERATURE`` (100); a value in (0, ``MIN_TEMPERATURE``) samples at 1e-2 (vLLM's rule:
            logits / temperature must stay finite in fp32).
        seed: sampling seed (same seed, same tokens), an int in [-2**63, 2**64 - 1 - batch size]; in a batch,
            stream i uses ``seed + i``.
        stop: at most ``MAX_STOP_STRINGS`` (16) strings of 1 .. ``MAX_STOP_CHARS`` (256) characters that end the
            generation (the text is cut before the first one to appear).
        chat: apply the model's chat template to a string prompt.
        prefill_depth: prefill ops in flight for this request (default: the engine's).
        spec: None, or "ngram" for lossless speculative decoding with prompt-lookup drafts (greedy only).
        spec_k: most draft tokens per verify segment (1 .. ``MAX_SPEC_K``). spec_depth: verify segments in
            flight per stream (the request's decode window is raised to it).
        spec_ngram: longest suffix n-gram the drafter matches.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit (OpenAI's rule; ids are
            checked against the vocabulary by the engine).
        presence_penalty, frequency_penalty: in [-2, 2]; ``presence * (count > 0) + frequency * count`` is
            subtracted from the logit of each token generated ``count`` times so far (OpenAI's rule).
        repetition_penalty: in [0.01, 100] (1 = off); a token seen in the prompt or the output has its logit
            divided by it when positive, multiplied when not (Keskar et al. 2019, CTRL; vLLM / HF's rule).
        min_tokens: EOS ids are masked until this many tokens are generated, and stop strings are not looked
            for in their text (vLLM's rule); at most ``max_new_tokens``.
        ignore_eos: EOS does not end the stream (it runs to ``max_new_tokens`` or a stop string).
        logprobs: None (off) or k in [0, ``MAX_TOP_LOGPROBS``]: each generated token's logprob and the k most
            likely tokens at its position (vLLM's ``SamplingParams.logprobs``). They are the raw model's
            log-softmax, before temperature, penalties and logit_bias (vLLM's default ``raw_logprobs``).
        prompt_logprobs: None (off) or k in [0, ``MAX_TOP_LOGPROBS``]: the logprob of each prompt token after
            the first given the ones before it, and the k most likely there (the first token has none).
        cache_salt: a tenant key (any string; vLLM's field): the prompt's prefix-cache chain is this key's
            alone, so another tenant cannot find out by timing which prefixes were served. None: the shared chain.
        structured_output: None, or a ``StructuredOutput`` (a JSON schema, JSON object, regex, choice or grammar)
            the output must follow: every token is chosen among those the grammar allows (greedy: the last
            stage's argmax among them; sampled: after penalties and logit_bias, before temperature / top-k /
            top-p), EOS only where the grammar accepts, and the stream ends ("stop") once the grammar is
            complete. With ``spec``, drafts are cut where the grammar refuses them and each verified position is
            masked as plain decoding masks it (the same tokens; one verify segment in flight).
        The order the sampler applies them in: ``ringshm.engine.sampling.Sampler``. Any of logit_bias, the penalties
        or min_tokens makes even a greedy request take the last stage's logits, and rules out ``spec``.

    Raises:
        ValueError: a field out of range, saying what to change.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False
    prefill_depth: int | None = None
    spec: str | None = None
    spec_k: int = 4
    spec_depth: int = 1
    spec_ngram: int = 3
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    structured_output: StructuredOutput | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether a logit control is set (logit_bias, a penalty, min_tokens): the next token is then chosen
        from processed logits, greedy or not."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or (
            self.repetition_penalty != 1 or self.min_tokens > 0)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no cut), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {shown(self.seed)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.prefill_depth is not None and (not isinstance(self.prefill_depth, int) or self.prefill_depth < 1):
            raise ValueError(f"prefill_depth must be an int >= 1, got {self.prefill_depth!r}")
        object.__setattr__(self, "stop", check_stop(self.stop))
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {SPEC_METHODS}, got {self.spec!r}")
        if self.spec is not None and self.temperature > 0:
            raise ValueError("speculative decoding here is greedy-only (lossless): use temperature 0 "
                             "(--temperature 0) or turn speculation off (spec=None, no --spec)")
        for name in ("spec_k", "spec_depth", "spec_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.spec_k > MAX_SPEC_K:
            raise ValueError(f"spec_k must be at most {MAX_SPEC_K} (drafts per verify segment), got {self.spec_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        check_repetition_penalty(self.repetition_penalty)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_new_tokens "
                             f"({self.max_new_tokens}): lower min_tokens or raise max_new_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_TOP_LOGPROBS}] (top-k count), got "
                                 f"{value!r}")
        if self.spec is not None and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise ValueError("speculative decoding does not return logprobs: drop logprobs / prompt_logprobs or "
                             "turn speculation off (spec=None, no --spec)")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, got "
                             f"{type(self.structured_output).__name__}")
        if self.structured_output is not None and self.stop:
            raise ValueError("stop strings would cut a structured output where its grammar does not end (a JSON "
                             "document half written): drop stop or the structured output")
        if self.structured_output is not None and self.min_tokens:
            raise ValueError("min_tokens cannot hold EOS back under a structured output (its grammar decides where "
                             "the output may end): drop min_tokens or the structured output")
        if self.spec is not None and self.processes_logits:
            raise ValueError("speculative decoding verifies the stage's plain argmax, so it cannot apply "
                             "logit_bias, presence/frequency/repetition penalties or min_tokens: drop those or "
                             "turn speculation off (spec=None, no --spec)")


def shown(value, n_chars: int = 40) -> str:
    """``repr(value)`` cut to about ``n_chars`` characters, for error messages (an int of 5,000 digits cannot even
    be turned into a string: Python's int-to-str limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= n_chars else text[:n_chars] + "..."


def check_temperature(temperature: float) -> float:
    """The temperature a request samples at: 0 (greedy) as is, a value in (0, ``MIN_TEMPERATURE``) raised to it.

    Raises:
        ValueError: below 0 or above ``MAX_TEMPERATURE``.
    """
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}")
    return max(float(temperature), MIN_TEMPERATURE) if temperature > 0 else 0.0


def check_repetition_penalty(r: float) -> None:
    """Raises ValueError unless ``r`` lies in ``REPETITION_PENALTY_RANGE`` (its fp32 arithmetic stays finite)."""
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= r <= hi:
        raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), got {r}")


def check_stop(stop) -> tuple[str, ...]:
    """``stop`` (a string, or a list / tuple of them) as a tuple of strings.

    Raises:
        ValueError: more than ``MAX_STOP_STRINGS`` strings, an empty one, one longer than ``MAX_STOP_CHARS``
            characters, or something that is not a string. The caps bound the text work a request brings to the
            dispatcher thread that serves every stream (``ringshm.engine.sampling.TextStream``).
    """
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) or not x for x in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    long = next((i for i, x in enumerate(stop) if len(x) > MAX_STOP_CHARS), None)
    if long is not None:
        raise ValueError(f"stop[{long}] has {len(stop[long])} characters; at most {MAX_STOP_CHARS} are allowed")
    return tuple(stop)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI: logit_bias values lie in [-100, 100]


def check_logit_bias(logit_bias, vocab: int | None = None) -> dict[int, float] | None:
    """``logit_bias`` as a fresh ``{token id: bias}`` dict (None when empty).

    Raises:
        ValueError: not a dict, a key that is not an int >= 0 (or, given ``vocab``, not below it), a bias that
            is not a finite number in [-100, 100].
    """
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    out = {}
    for token, bias in logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if vocab is not None and token >= vocab:
            raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        out[token] = float(bias)
    return out or None
