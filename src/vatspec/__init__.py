"""vatspec: Verification-Aware Training (VAT) for speculative-decoding drafters."""

__version__ = "0.1.0"
