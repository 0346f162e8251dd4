"""Record formats: which of TRL's dataset formats a record is, and the tokens it trains on.

SFT, one document per record (``scored[i]``: token ``i`` is a target of the loss):

    {"text": "..."}                                   language modeling: every token
    {"messages": [{"role": ..., "content": ...}]}     conversational, the tokenizer's chat template:
                                                      the assistant's tokens (data.assistant_only_loss)
    {"prompt": "...", "completion": "..."}            prompt-completion: the completion's tokens
    {"prompt": [messages], "completion": [messages]}  (data.completion_only_loss), strings or messages

Preference (DPO and reward models), one sample of a prompt and K >= 2 responses:

    {"prompt", "chosen", "rejected"}                  explicit prompt, strings or message lists
    {"chosen", "rejected"}                            implicit prompt: their longest common beginning
                                                      (TRL's ``extract_prompt``)
    {"prompt", "responses": [...], "scores": [...]}   reward models: K responses ranked by score

The tokens are TRL's for the same record and tokenizer (its SFT, DPO and reward trainers'
preprocessing, ``trl`` 1.x): text is tokenized with the tokenizer's special tokens and its EOS
appended (unless the text ends with it); messages through ``apply_chat_template``; a prompt's tokens
are the common beginning of the prompt's and the prompt+completion's tokens (a template may render a
prompt alone differently: the completion starts where they part). A tokenizer without an EOS (the
byte tokenizer) starts each text document with its separator instead, so that documents never run
together. A record of no format, or one whose tokens score nothing, raises :class:`DataError` naming
where it is (``file:line``) and the formats accepted.

    tokens = HFTokens(AutoTokenizer.from_pretrained(path))            # or the trainer's byte tokenizer
    ids, scored = sft_document(tokens, record, where, assistant_only=True, completion_only=True)
    prompt, responses, scores = preference_sample(tokens, record, where)

One module for both front doors: the trainer's data (:mod:`fm_parallel.trainer.data`) and the HF
trainers' text examples (:mod:`fm_parallel.integrations.text_examples`).
"""

from __future__ import annotations

import re

__all__ = ["DataError", "HFTokens", "json_kind", "open_responses", "SFT_FORMATS", "PREFERENCE_FORMATS", "sft_document", "preference_sample", "preference_responses",
           "common_prefix_length", "is_messages", "assistant_mask"]


class DataError(ValueError):
    """A data file or data setting the user must fix; the message names ``file:line``."""


class HFTokens:
    """A Hugging Face tokenizer as the formats use it (the interface the byte tokenizer also has):
    ``text_ids`` (``tokenizer(text)``, special tokens included, as TRL tokenizes), ``eos_text``,
    ``chat_template``, ``chat_ids`` and the separator ``bos_id`` (BOS, else EOS)."""

    def __init__(self, tokenizer, name: str = ""):
        self.tok = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.vocab_size = len(tokenizer)
        self.bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.bos_id
        self.eos_text = tokenizer.eos_token or ""

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text_ids(self, text: str) -> list[int]:
        """``tokenizer(text)``'s ids, special tokens included (a BOS where the tokenizer adds one), as TRL tokenizes."""
        return list(self.tok(text)["input_ids"])

    def chat_template(self, where: str = "") -> str | None:
        template = self.tok.chat_template
        return template if isinstance(template, str) else None

    def chat_ids(self, messages, where: str, add_generation_prompt: bool = False, assistant_mask: bool = False):
        """``(ids, assistant mask or None)`` of a conversation through the tokenizer's chat template."""
        if not self.tok.chat_template:
            raise DataError(f"{where}: a conversation (a message list) needs a tokenizer with a chat template; the "
                            f"tokenizer of {self.name} has none")
        try:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               add_generation_prompt=add_generation_prompt,
                                               return_assistant_tokens_mask=assistant_mask)
        except Exception as e:  # noqa: BLE001 - a template raises its own errors (jinja's, or raise_exception)
            raise DataError(f"{where}: the chat template of {self.name} refused the conversation "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
        ids = list(out["input_ids"])
        return ids, (list(out["assistant_masks"]) if assistant_mask else None)


SFT_FORMATS = ('{"text": str}', '{"messages": [{"role", "content"}, ...]}',
               '{"prompt", "completion"} (strings, or message lists)')
PREFERENCE_FORMATS = ('{"prompt", "chosen", "rejected"} (strings, or message lists)',
                      '{"chosen", "rejected"} (the prompt implicit: their common beginning)')
RM_EXTRA_FORMAT = '{"prompt", "responses": [...], "scores": [...]}'

# A chat template that marks the assistant's tokens itself (transformers' return_assistant_tokens_mask).
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def json_kind(value) -> str:
    """How an error names a JSON value's type: "a string", "an array", "null", ..."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def is_messages(value) -> bool:
    """``value`` is a conversation: a non-empty list of ``{"role": str, "content": ...}`` objects."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share (TRL's ``common_prefix_length``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_text(where: str, name: str, value) -> None:
    """Refuse a string (or a conversation's contents) that is not valid Unicode."""
    texts = [value] if isinstance(value, str) else [m.get("content") for m in value if isinstance(m, dict)]
    for text in (t for t in texts if isinstance(t, str)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape like "\ud800": no tokenizer can encode it
            raise DataError(f"{where}: field {name!r} holds an unpaired surrogate {text[e.start]!r} at character "
                            f"{e.start}, not valid Unicode") from None


def _unknown(where: str, record: dict, formats, what: str) -> DataError:
    fields = {k: json_kind(v) for k, v in list(record.items())[:6]}
    return DataError(f"{where}: expected {what} record of one of the formats " + "; ".join(formats)
                     + f"; got fields {fields}")


def _with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_text
    return text + eos if eos and not text.endswith(eos) else text


def assistant_mask(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a conversation: its chat-template tokens, and 1 on the assistant's.

    A template with ``{% generation %}`` marks them itself (transformers' assistant-token mask, what
    TRL's ``assistant_only_loss`` reads). One without (SmolLM2's, Qwen's): each assistant turn's tokens
    are those the conversation up to that turn adds to the conversation before it rendered with the
    generation prompt (the turn's content and its end-of-turn tokens); refused naming ``where`` when a
    template renders a conversation's beginning differently alone."""
    if _GENERATION_TAG.search(tokenizer.chat_template(where) or ""):
        return tokenizer.chat_ids(messages, where, assistant_mask=True)
    ids, _ = tokenizer.chat_ids(messages, where)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = tokenizer.chat_ids(messages[:k], where, add_generation_prompt=True) if k else ([], None)
        through, _ = tokenizer.chat_ids(messages[: k + 1], where)
        if through != ids[: len(through)] or before != through[: len(before)]:
            raise DataError(f"{where}: the chat template renders the conversation's first {k + 1} message(s) "
                            "differently from the whole conversation, so the assistant's tokens cannot be found; use "
                            "a template with {% generation %} markers, or set data.assistant_only_loss = false")
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return ids, mask


def sft_document(tokenizer, record: dict, where: str, assistant_only: bool = True,
                 completion_only: bool = True) -> tuple[list[int], list[bool]]:
    """``(ids, scored)`` of the SFT ``record`` found at ``where``, as TRL's ``SFTTrainer`` tokenizes it.

    ``assistant_only``: a conversation scores its assistant tokens only (TRL's ``assistant_only_loss``);
    ``completion_only``: a prompt-completion record scores its completion only (TRL's
    ``completion_only_loss``, on by default there too)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {json_kind(record)}")
    if "text" in record and isinstance(record["text"], str):
        _check_text(where, "text", record["text"])
        ids = tokenizer.text_ids(_with_eos(tokenizer, record["text"]))
        if not tokenizer.eos_text:
            ids = [tokenizer.bos_id] + ids  # no EOS to end a document: the separator starts it
        return ids, [True] * len(ids)
    if "messages" in record and is_messages(record["messages"]):
        _check_text(where, "messages", record["messages"])
        if assistant_only:
            ids, mask = assistant_mask(tokenizer, record["messages"], where)
            if not any(mask):
                raise DataError(f"{where}: a conversation without assistant tokens has nothing to train on with "
                                "data.assistant_only_loss = true (no assistant message)")
            return ids, [bool(m) for m in mask]
        ids, _ = tokenizer.chat_ids(record["messages"], where)
        return ids, [True] * len(ids)
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        _check_text(where, "prompt", prompt)
        _check_text(where, "completion", completion)
        prompt_ids = tokenizer.text_ids(prompt)
        ids = tokenizer.text_ids(_with_eos(tokenizer, prompt + completion))
        mask = [1] * len(ids)
    elif is_messages(prompt) and is_messages(completion):
        _check_text(where, "prompt", prompt)
        _check_text(where, "completion", completion)
        prompt_ids, _ = tokenizer.chat_ids(prompt, where, add_generation_prompt=True)
        if assistant_only:
            ids, mask = assistant_mask(tokenizer, prompt + completion, where)
        else:
            ids = tokenizer.chat_ids(prompt + completion, where)[0]
            mask = [1] * len(ids)
    else:
        raise _unknown(where, record, SFT_FORMATS, "an SFT")
    start = common_prefix_length(prompt_ids, ids) if completion_only else 0
    scored = [i >= start and bool(m) for i, m in enumerate(mask)]
    if not any(scored):
        raise DataError(f"{where}: the completion adds no tokens to the prompt's, so nothing is trained on")
    return ids, scored


def _extract_prompt(chosen, rejected):
    """TRL's ``extract_prompt``: the longest common beginning of ``chosen`` and ``rejected`` (whole
    messages of two conversations, or characters of two strings, not ending inside a word's space)."""
    for i in range(min(len(chosen), len(rejected))):
        if chosen[i] != rejected[i]:
            if isinstance(chosen, str) and i > 0 and chosen[i - 1] == " ":
                i -= 1  # the space belongs to the responses (TRL's rule)
            return chosen[:i], chosen[i:], rejected[i:]
    i = min(len(chosen), len(rejected))
    return chosen[:i], chosen[i:], rejected[i:]


def preference_responses(record: dict, where: str, ranked: bool = False) -> tuple[object, list, list[float]]:
    """``(prompt, responses, scores)`` of a preference record, before tokenizing: ``chosen`` scores 1 and
    ``rejected`` 0; ``ranked``: ``{"prompt", "responses", "scores"}`` is accepted too (reward models)."""
    formats = PREFERENCE_FORMATS + ((RM_EXTRA_FORMAT,) if ranked else ())
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {json_kind(record)}")
    if ranked and ("responses" in record or "scores" in record):
        import math

        responses, scores = record.get("responses"), record.get("scores")
        if "chosen" in record or "rejected" in record:
            raise DataError(f"{where}: expected either chosen / rejected or responses / scores, got both forms")
        if not isinstance(responses, list) or not all(isinstance(r, str) or is_messages(r) for r in responses):
            raise DataError(f"{where}: expected 'responses' as a list of strings or message lists, got {json_kind(responses)}")
        if (not isinstance(scores, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)
                or not all(math.isfinite(x) for x in scores)):
            raise DataError(f"{where}: expected 'scores' as a list of finite numbers, got {json_kind(scores)}")
        if len(scores) != len(responses):
            raise DataError(f"{where}: expected one score per response, got {len(scores)} scores for {len(responses)} responses")
        if not isinstance(record.get("prompt"), (str, list)):
            raise _unknown(where, record, formats, "a preference")
        prompt, scores = record["prompt"], [float(x) for x in scores]
    else:
        chosen, rejected = record.get("chosen"), record.get("rejected")
        strings = isinstance(chosen, str) and isinstance(rejected, str)
        if not (strings or (is_messages(chosen) and is_messages(rejected))):
            raise _unknown(where, record, formats, "a preference")
        if "prompt" in record:
            prompt = record["prompt"]
        else:
            prompt, chosen, rejected = _extract_prompt(chosen, rejected)
        responses, scores = [chosen, rejected], [1.0, 0.0]
    conversational = is_messages(prompt) or (prompt == [] and all(is_messages(r) for r in responses))
    if not (isinstance(prompt, str) and all(isinstance(r, str) for r in responses)) and not (
            conversational and all(is_messages(r) for r in responses)):
        raise DataError(f"{where}: expected the prompt and every response alike, all strings or all message lists; got "
                        f"prompt {json_kind(prompt)} and responses {[json_kind(r) for r in responses]}")
    if len(responses) < 2 or len(set(scores)) < 2:
        raise DataError(f"{where}: expected at least two responses with different scores (a ranking to learn), got "
                        f"{len(responses)} response(s) with scores {scores}")
    empty = [i for i, r in enumerate(responses) if not r]
    if empty:
        raise DataError(f"{where}: expected non-empty responses, got an empty response at index {empty[0]}")
    _check_text(where, "prompt", prompt)
    for i, r in enumerate(responses):
        _check_text(where, "chosen" if i == 0 and "chosen" in record else "rejected" if i == 1 and "rejected" in record
                    else f"responses[{i}]", r)
    return prompt, responses, scores


def preference_sample(tokenizer, record: dict, where: str, ranked: bool = False) -> tuple[list[int], list[list[int]], list[float]]:
    """``(prompt ids, [response ids, ...], scores)`` of a preference record, as TRL's ``DPOTrainer``
    tokenizes it: ``prompt + response`` whole (with the EOS appended to a string response), the prompt's
    tokens the common beginning of the prompt's own and every ``prompt + response``'s; a response is what
    follows. (TRL's reward trainer scores each ``prompt + response`` whole: the same tokens.)"""
    prompt, responses, scores = preference_responses(record, where, ranked)
    if isinstance(prompt, str):
        prompt_ids = tokenizer.text_ids(prompt)
        whole = [tokenizer.text_ids(_with_eos(tokenizer, prompt + r)) for r in responses]
    else:
        prompt_ids = tokenizer.chat_ids(prompt, where, add_generation_prompt=True)[0] if prompt else []
        whole = [tokenizer.chat_ids(prompt + r, where)[0] for r in responses]
    start = min(common_prefix_length(prompt_ids, w) for w in whole)
    tails = [w[start:] for w in whole]
    empty = [i for i, t in enumerate(tails) if not t]
    if empty:
        raise DataError(f"{where}: response {empty[0]} adds no tokens to the prompt's, so it has nothing to score")
    return whole[0][:start], tails, scores


def open_responses(prompt: list[int], responses: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """``(prompt[:-1], [prompt[-1:] + r, ...])``: the prompt's last token opens each response. A row
    that shares one prompt between responses cannot score a response's first token from the prompt's
    last position (one position, several targets); opened this way, each response's first token is
    predicted from inside the response, and each ``prompt + response`` stays TRL's token for token. An
    empty prompt: as given (nothing predicts a first token in TRL's sequence either)."""
    return (prompt[:-1], [prompt[-1:] + r for r in responses]) if prompt else (prompt, list(responses))
