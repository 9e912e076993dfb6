"""The HTTP front end: an OpenAI-compatible app (FastAPI, hosted by Ray Serve) in front of an `Engine`.

It validates and tokenizes requests, detokenizes and streams what the engine generates, matches stop
strings, and turns every bad input into OpenAI's error shape. What it needs of the engine is the
protocol in `engine.py`; nothing else of the serving code.
"""
