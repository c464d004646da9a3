"""A module global a block's forward reads (``tests/trust/test_trust_rare.py``)."""

MODE = "a"
