"""The tiny generated models kvscope runs vLLM with (no model hub): their configs, which
the twin also builds vLLM's scheduler from, and their random weights and tokenizer.

It imports nothing of kvscope.
"""
