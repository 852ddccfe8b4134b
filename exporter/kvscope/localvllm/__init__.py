"""A real vLLM OpenAI server on this machine (``server``), started on a free loopback port
with a tiny generated model (``kvscope.models``), stopped by its process group.

It imports nothing of kvscope (it starts vLLM in its own process).
"""
