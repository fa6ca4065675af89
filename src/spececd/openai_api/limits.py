"""What ``spececd api`` bounds a request by, by default (its ``--max-request-bytes`` and
``--request-timeout``); kept apart so that the command line reads them without FastAPI."""

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # a body over this is answered 413
DEFAULT_REQUEST_TIMEOUT = 10.0  # seconds to send a whole request; a slower one gets a 408
