"""Text <-> token ids: the tokenizer, chat formatting and incremental detokenization. Torch-free."""
