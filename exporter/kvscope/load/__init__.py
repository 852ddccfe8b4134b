"""Load for an OpenAI-compatible server: the seeded request mix (``mix``) and the
``kvscope loadgen`` command around it (``cli``).

It may import the shared helpers only; it talks to a server over HTTP.
"""
