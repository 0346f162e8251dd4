"""Text preference datasets for the HF preference trainers: TRL's records in, token ids out.

``FlashMaskDPOTrainer`` and ``FlashMaskRewardTrainer`` take the datasets TRL's ``DPOTrainer`` and
``RewardTrainer`` take (``{"prompt", "chosen", "rejected"}`` as strings or conversations, or the
implicit-prompt ``{"chosen", "rejected"}``; the reward trainer also ``{"prompt", "responses",
"scores"}``), given ``processing_class=tokenizer``: each record is tokenized as TRL tokenizes it
(:func:`fm_parallel.formats.preference_sample`: the chat template for conversations, the EOS after a
string response) into the examples :class:`~fm_parallel.integrations.collator.FlashMaskCollator` packs.
Token-id datasets (``prompt_ids``, ...) pass through unchanged.

    examples = preference_examples(dataset, tokenizer, objective="dpo", name="train_dataset")

DPO: a shared-prompt row cannot score a response's first token from the prompt's last position (it is
shared by both responses), so the prompt's last token opens each response instead: the responses'
sequences are TRL's ``prompt + response`` token for token, every response token scored as TRL scores
it, the losses TRL's.
"""

from __future__ import annotations

from fm_parallel.formats import HFTokens, preference_sample

__all__ = ["preference_examples", "is_text_dataset", "tokenize_datasets"]

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


def preference_examples(dataset, tokenizer, objective: str, name: str = "train_dataset"):
    """``dataset`` (a list of dicts, a ``datasets.Dataset`` / ``IterableDataset``, or a dict of them as
    ``eval_dataset`` may be) with text records replaced by token-id examples; a token-id dataset, or
    None, as given. ``objective``: ``"dpo"`` (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) or
    ``"rm"`` (``prompt_ids``, ``response_ids``, ``scores``; a pair scores 1 and 0). ``tokenizer``: the
    trainer's ``processing_class``. A record of no format raises ``ValueError`` naming
    ``name[index]`` and the formats accepted."""
    if objective not in ("dpo", "rm"):
        raise ValueError(f"objective: expected 'dpo' or 'rm', got {objective!r}")
    if isinstance(dataset, dict) and not _looks_like_an_example(dataset):
        return {k: preference_examples(v, tokenizer, objective, f"{name}[{k!r}]") for k, v in dataset.items()}
    if not is_text_dataset(dataset):
        return dataset
    if tokenizer is None:
        raise ValueError(f"processing_class: expected the tokenizer that tokenizes {name}'s text records (TRL's "
                         "preference formats), got None; pass processing_class=tokenizer, or token ids "
                         "(prompt_ids, chosen_ids, rejected_ids)")
    tokens = tokenizer if hasattr(tokenizer, "chat_ids") else HFTokens(getattr(tokenizer, "tokenizer", tokenizer))

    def convert(record, index: int) -> dict:
        record = dict(record) if hasattr(record, "keys") else record  # datasets' rows are mappings (LazyRow)
        prompt, responses, scores = preference_sample(tokens, record, f"{name}[{index}]", ranked=objective == "rm")
        if objective == "rm":
            return {"prompt_ids": prompt, "response_ids": responses, "scores": scores}
        if prompt:  # the prompt's last token opens each response: every response token is scored, as in TRL
            prompt, responses = prompt[:-1], [prompt[-1:] + r for r in responses]
        return {"prompt_ids": prompt, "chosen_ids": responses[0], "rejected_ids": responses[1]}

    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):  # datasets.Dataset / IterableDataset
        return dataset.map(convert, with_indices=True, remove_columns=list(dataset.column_names or []))
    return [convert(record, i) for i, record in enumerate(dataset)]


def _looks_like_an_example(value: dict) -> bool:
    return any(k in value for k in ("prompt", "chosen", "rejected", "responses", *_ID_FIELDS))


def tokenize_datasets(kwargs: dict, objective: str) -> dict:
    """A trainer's keyword arguments with ``train_dataset`` and ``eval_dataset`` as token-id examples
    (:func:`preference_examples` with its ``processing_class``); the rest as given."""
    out = dict(kwargs)
    for key in ("train_dataset", "eval_dataset"):
        if out.get(key) is not None:
            out[key] = preference_examples(out[key], out.get("processing_class"), objective, key)
    return out
