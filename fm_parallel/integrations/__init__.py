"""Integrations with other libraries: transformers' attention backend and ``Trainer`` under context
parallelism (``transformers``, ``context_parallel``, ``collator``), TRL's DPO and reward trainers
(``dpo``, ``reward``, ``text_examples``) and DeepSpeed's sequence parallelism (``deepspeed``)."""
