"""The request path: the driver, and each attempt at a request through the deployment.

`driver.py`: `Server`, with backpressure and retries; `attempts.py`: the one owner of each request's
attempt and the deadline on its result; `remote_path.py`: a disaggregated attempt (reserve, prefill
and send, in batches per prefill worker); `local_path.py`: a local prefill on decode (or every
request, colocated); `reservations.py`: where a destination is reserved; `attempt_errors.py`: how an
attempt ends without its result; `faults.py`: which fault an attempt gets; `request_stream.py`: one
request as its caller reads it.
"""

from distpool.serving.path.driver import ServeOptions, Server, ServerClosed

__all__ = [
    "ServeOptions",
    "Server",
    "ServerClosed",
]
