"""What several test modules share, written once: the protocol's test frames
(:mod:`tests.support.protocol`), a server in a background thread
(:mod:`tests.support.servers`) and the backend conformance loop
(:mod:`tests.support.conformance`). Fixtures stay in the ``conftest.py`` files."""
