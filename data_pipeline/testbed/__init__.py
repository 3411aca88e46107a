"""The embedded testbed: a synthetic reasoning task, its tokenizer and an oracle evictor."""
