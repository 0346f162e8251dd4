"""Text preference datasets for the HF preference trainers: TRL's records in, token ids out.

``FlashMaskDPOTrainer`` and ``FlashMaskRewardTrainer`` take the datasets TRL's ``DPOTrainer`` and
``RewardTrainer`` take (``{"prompt", "chosen", "rejected"}`` as strings or conversations, or the
implicit-prompt ``{"chosen", "rejected"}``; the reward trainer also ``{"prompt", "responses",
"scores"}``), given ``processing_class=tokenizer``: each record is tokenized as TRL tokenizes it
(:func:`fm_parallel.formats.preference_sample`: the chat template for conversations, the EOS after a
string response) into the examples :class:`~fm_parallel.integrations.collator.FlashMaskCollator` packs.
Token-id datasets (``prompt_ids``, ...) pass through unchanged.

    examples = dpo_examples(dataset, tokenizer)          # or reward_examples(dataset, tokenizer)

DPO: a shared-prompt row cannot score a response's first token from the prompt's last position (it is
shared by both responses), so the prompt's last token opens each response instead: the responses'
sequences are TRL's ``prompt + response`` token for token, every response token scored as TRL scores
it, the losses TRL's.
"""

from __future__ import annotations

from fm_parallel.formats import HFTokens, open_responses, preference_sample

__all__ = ["dpo_examples", "reward_examples", "is_text_dataset", "tokenize_datasets"]

_ID_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids", "response_ids", "input_ids")


def _first(dataset):
    try:
        return next(iter(dataset))
    except StopIteration:
        return None


def is_text_dataset(dataset) -> bool:
    """Whether ``dataset``'s examples are text records (no token-id field): what needs a tokenizer."""
    first = _first(dataset) if dataset is not None else None
    return isinstance(first, dict) and not any(k in first for k in _ID_FIELDS)


def dpo_examples(dataset, tokenizer, name: str = "train_dataset"):
    """``dataset`` with TRL's ``DPOTrainer`` text records replaced by ``{"prompt_ids", "chosen_ids",
    "rejected_ids"}``, each response opened by the prompt's last token (see the module's docstring).
    See :func:`_tokenized` for what ``dataset`` may be."""

    def convert(tokens, record, where):
        prompt, responses = open_responses(*preference_sample(tokens, record, where)[:2])  # every response token scored
        return {"prompt_ids": prompt, "chosen_ids": responses[0], "rejected_ids": responses[1]}

    return _tokenized(dataset, tokenizer, name, convert)


def reward_examples(dataset, tokenizer, name: str = "train_dataset"):
    """``dataset`` with TRL's ``RewardTrainer`` text records (and ``{"prompt", "responses", "scores"}``)
    replaced by ``{"prompt_ids", "response_ids", "scores"}`` (a pair scores 1 and 0): each
    ``prompt + response`` is TRL's sequence. See :func:`_tokenized` for what ``dataset`` may be."""

    def convert(tokens, record, where):
        prompt, responses, scores = preference_sample(tokens, record, where, ranked=True)
        return {"prompt_ids": prompt, "response_ids": responses, "scores": scores}

    return _tokenized(dataset, tokenizer, name, convert)


def _tokenized(dataset, tokenizer, name: str, convert):
    """``dataset`` (a list of dicts, a ``datasets.Dataset`` / ``IterableDataset``, or a dict of them as
    ``eval_dataset`` may be) with each text record replaced by ``convert(tokens, record, where)``; a
    token-id dataset, or None, as given. ``tokenizer``: the trainer's ``processing_class``. A record
    of no format raises ``ValueError`` naming ``name[index]`` and the formats accepted."""
    if isinstance(dataset, dict) and not _looks_like_an_example(dataset):
        return {k: _tokenized(v, tokenizer, f"{name}[{k!r}]", convert) for k, v in dataset.items()}
    if not is_text_dataset(dataset):
        return dataset
    if tokenizer is None:
        raise ValueError(f"processing_class: expected the tokenizer that tokenizes {name}'s text records (TRL's "
                         "preference formats), got None; pass processing_class=tokenizer, or token ids "
                         "(prompt_ids, chosen_ids, rejected_ids)")
    tokens = tokenizer if hasattr(tokenizer, "chat_ids") else HFTokens(getattr(tokenizer, "tokenizer", tokenizer))

    def one(record, index: int) -> dict:
        record = dict(record) if hasattr(record, "keys") else record  # datasets' rows are mappings (LazyRow)
        return convert(tokens, record, f"{name}[{index}]")

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):  # datasets.Dataset / IterableDataset
        return dataset.map(one, with_indices=True, remove_columns=list(dataset.column_names or []))
    return [one(record, i) for i, record in enumerate(dataset)]


def _looks_like_an_example(value: dict) -> bool:
    return any(k in value for k in ("prompt", "chosen", "rejected", "responses", *_ID_FIELDS))


def tokenize_datasets(kwargs: dict, examples) -> dict:
    """A trainer's keyword arguments with ``train_dataset`` and ``eval_dataset`` through ``examples``
    (:func:`dpo_examples` or :func:`reward_examples`) with its ``processing_class``; the rest as given."""
    out = dict(kwargs)
    for key in ("train_dataset", "eval_dataset"):
        if out.get(key) is not None:
            out[key] = examples(out[key], out.get("processing_class"), key)
    return out
