"""Detokenizer process: scheduler token ids -> cumulative text for the tokenizer manager."""
