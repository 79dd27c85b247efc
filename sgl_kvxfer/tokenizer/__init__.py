"""Tokenizer manager (HTTP process): tokenize, send to the scheduler, gather detokenized output."""
