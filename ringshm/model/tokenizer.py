"""Tokenizer and chat template of a checkpoint, through transformers (GGUF metadata or an HF directory).

Building a tokenizer from GGUF metadata (vocab, merges, chat template) takes seconds, so the converted
tokenizer is saved once under ``~/.cache/ringshm/tokenizers/<key>/`` and loaded from there afterwards. The
key hashes the file's resolved path and its header (``ringshm.model.fingerprint.checkpoint_digest``: size,
metadata, tokenizer, tensor table), so a file with another tokenizer never reads this one's entry, whatever
its name, size and times.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ringshm.errors import InvalidCheckpoint, MissingChatTemplate

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ringshm"


def tokenizer_cache_key(gguf_path: str | Path) -> str:
    """Return the cache key of a GGUF file's tokenizer: sha256 of its resolved path and its
    ``checkpoint_digest`` (the whole header and the file's size), 16 hex digits.

    Raises:
        FileNotFoundError, InvalidCheckpoint: as ``GGUFIndex.open``.
    """
    from ringshm.model.fingerprint import checkpoint_digest

    path = Path(gguf_path).resolve()
    return hashlib.sha256(f"{path}|{checkpoint_digest(path)}".encode()).hexdigest()[:16]


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_path: str | Path) -> bool:
    """Whether a ``.gguf`` file (``tokenizer.ggml.model`` in its metadata) or an HF directory (one of
    ``HF_TOKENIZER_FILES``) carries a tokenizer. A checkpoint without one still serves token-id prompts."""
    path = Path(model_path)
    if path.is_dir():
        return any((path / name).is_file() for name in HF_TOKENIZER_FILES)
    from ringshm.model.gguf_index import GGUFIndex

    return GGUFIndex.open(path).meta.get("tokenizer.ggml.model") is not None


CHAT_TEMPLATE_HELP = ("give a prompt without --chat / chat=True (or use /v1/completions), or a checkpoint that "
                      "carries a template (an instruction-tuned '-it' / '-Instruct' file; an HF directory with "
                      "'chat_template' in tokenizer_config.json or a chat_template.jinja)")


def has_chat_template(model_path: str | Path) -> bool:
    """Whether a ``.gguf`` file (``tokenizer.chat_template`` in its metadata) or an HF directory
    (``chat_template`` in ``tokenizer_config.json``, or a ``chat_template.jinja`` / ``chat_template.json`` file)
    carries a chat template. Reads the header or the small JSON only: no tokenizer is built."""
    path = Path(model_path)
    if path.is_dir():
        if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
            return True
        try:
            return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
        except (OSError, ValueError, AttributeError):
            return False
    from ringshm.model.gguf_index import GGUFIndex

    return isinstance(GGUFIndex.open(path).meta.get("tokenizer.chat_template"), str)


def check_chat_template(model_path: str | Path) -> None:
    """Refuse chat on a checkpoint without a chat template, before anything starts.

    Raises:
        MissingChatTemplate: it carries none (the message names the file and what to do instead).
    """
    if not has_chat_template(model_path):
        raise MissingChatTemplate(f"{model_path} carries no chat template, so it cannot format a chat: "
                                  f"{CHAT_TEMPLATE_HELP}")


def load_tokenizer(model_path: str | Path, cache_dir: str | Path | None = None):
    """Return a transformers tokenizer (with its chat template) for a ``.gguf`` file or an HF directory.

    For GGUF, the first call converts the metadata with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
    and saves the result under ``cache_dir`` (default ``~/.cache/ringshm``)/tokenizers/<key>; later calls
    load the saved copy. An HF directory is loaded as is.

    An HF directory's tokenizer may hold fewer tokens than the embedding has rows (padded vocabularies), never
    more: an id past the rows has no embedding. (A GGUF's token list must equal the rows: the checkpoint check.)

    Raises:
        FileNotFoundError: ``model_path`` is neither a ``.gguf`` file nor a directory.
        InvalidCheckpoint: an HF tokenizer with more tokens than the config's ``vocab_size``, or tokenizer files /
            metadata transformers cannot build a tokenizer from (its error, in one line).
    """
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is wanted

    path = Path(model_path)

    def build(source: Path, **kw):
        """transformers' tokenizer; its own errors on malformed tokenizer data (KeyError, TypeError, OSError,
        ...) as one InvalidCheckpoint line naming the checkpoint. A GGUF of an architecture transformers' GGUF
        reader does not know (olmoe) is built by the fast tokenizer class directly: ``AutoTokenizer`` would read
        a model config from the file first, and only the ``tokenizer.*`` keys matter."""
        cls = AutoTokenizer
        if kw.get("gguf_file") and not _transformers_reads_arch(path):
            from transformers import PreTrainedTokenizerFast as cls
        try:
            return cls.from_pretrained(str(source), **kw)
        except Exception as exc:
            what = "tokenizer files" if path.is_dir() else "GGUF tokenizer metadata"
            raise InvalidCheckpoint(f"{path}: transformers could not build a tokenizer from its {what} "
                                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from exc

    if path.is_dir():
        from ringshm.model.hf_index import MAX_CONFIG_BYTES, read_json_object

        tok = build(path)
        vocab = read_json_object(path / "config.json", MAX_CONFIG_BYTES).get("vocab_size")
        if isinstance(vocab, int) and len(tok) > vocab:
            raise InvalidCheckpoint(f"{path}: the tokenizer holds {len(tok)} tokens but 'vocab_size' (the "
                                    f"embedding's rows) is {vocab}: ids past it have no embedding")
        return tok
    if not (path.is_file() and path.suffix == ".gguf"):
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a model directory")
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    entry = root / "tokenizers" / tokenizer_cache_key(path)
    if (entry / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(entry))
    tok = build(path.parent, gguf_file=path.name)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, entry)  # atomic publish; a concurrent writer's identical entry may win
    except OSError:
        if not (entry / "tokenizer_config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _transformers_reads_arch(path: Path) -> bool:
    """Whether transformers' GGUF reader knows the architecture of the GGUF at ``path`` (its supported list)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from ringshm.model.gguf_index import GGUFIndex

    arch = GGUFIndex.open(path).meta.get("general.architecture")
    return {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(arch, arch) in GGUF_SUPPORTED_ARCHITECTURES


def check_text(text: str, what: str = "prompt") -> None:
    """Raise ``ValueError`` when ``text`` cannot be encoded as UTF-8 (a lone surrogate such as ``\\udfff``,
    which JSON's ``\\u`` escapes can carry but no tokenizer can encode); the message says where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at "
                         f"character {exc.start}; send UTF-8 text (surrogates only in valid pairs)") from None


def encode_text(tokenizer, text: str, what: str = "prompt") -> list[int]:
    """Token ids of plain ``text`` with the tokenizer's usual added tokens (e.g. BOS). Special-token
    spellings inside ``text`` (``<|im_end|>``) are tokenised as the characters they are, never as markers.

    Raises:
        ValueError: ``text`` is not valid Unicode (``check_text``).
    """
    check_text(text, what)
    return [int(t) for t in tokenizer(text, split_special_tokens=True)["input_ids"]]


def special_spellings(tokenizer) -> list[str]:
    """The texts of ``tokenizer``'s special tokens (added tokens marked special), longest first: where a chat
    template's text is split into its markers (``encode_chat``), and what text written by the template outside the
    content placeholders must not spell (``ringshm.server.tool_formats``)."""
    return sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content", ...}]``: other keys, e.g. an assistant's ``tool_calls``,
    go to the template as they are) through the model's chat template, where only the template adds turn markers:
    each message's content is tokenised as plain text, so ``<|im_end|>`` or ``<|im_start|>system`` typed by a user
    cannot close or open a turn. ``tools``: transformers' ``apply_chat_template(tools=...)`` (OpenAI's function
    entries), for a template that describes them itself; what the template writes of them (and of ``tool_calls``)
    is template text, so a caller refuses special-token spellings in them first.

    How: the template is rendered with a unique placeholder per content. The tokenizer itself splits text at
    special tokens and tokenises the runs between them independently; here the template's text is split at
    its special tokens, each content is put back into its run, and each run is tokenised with
    ``split_special_tokens``. So for contents without special-token spellings the ids equal
    ``apply_chat_template(..., tokenize=True)`` exactly.

    Raises:
        MissingChatTemplate: the tokenizer has no chat template.
        ValueError: a content is not valid Unicode, or the template alters contents (so they cannot be
            tokenised apart from it). An empty content the template leaves out (an assistant turn that is only
            tool calls) is no alteration.
    """
    import re
    import secrets

    if not getattr(tokenizer, "chat_template", None):
        raise MissingChatTemplate(f"the model's tokenizer carries no chat template, so it cannot format a chat: "
                                  f"{CHAT_TEMPLATE_HELP}")

    key = secrets.token_hex(6)
    marks = [f"\ue000{key}:{i}\ue001" for i in range(len(messages))]
    for i, msg in enumerate(messages):
        check_text(msg["content"], f"messages[{i}].content")
    rendered = tokenizer.apply_chat_template([dict(msg, content=mark) for msg, mark in zip(messages, marks)],
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    specials = special_spellings(tokenizer)
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
    pieces: list[tuple[str, bool]] = []  # (text, is a special token of the template)
    rest = rendered
    for i, msg in enumerate(messages + [None]):
        if msg is not None:
            head, found, after = rest.partition(marks[i])
            if not found and not msg["content"]:
                continue  # an empty content the template leaves out
            rest = after
            if not found:
                raise ValueError("the model's chat template alters message contents; ringshm tokenises contents "
                                 "apart from the template's markers and cannot use this template")
        else:
            head = rest
        parts = split.split(head) if split else [head]
        pieces += [(p, j % 2 == 1) for j, p in enumerate(parts) if p]
        if msg is not None:
            pieces.append((msg["content"], False))
    ids: list[int] = []
    run: list[str] = []
    for text, special in pieces + [("", True)]:
        if not special:
            run.append(text)
            continue
        if run:
            ids += tokenizer("".join(run), add_special_tokens=False, split_special_tokens=True)["input_ids"]
            run = []
        if text:
            ids.append(tokenizer.convert_tokens_to_ids(text))
    return [int(t) for t in ids]
