"""pdlab: measure prefill/decode disaggregation against a unified engine on one machine."""

__version__ = "0.1.0"
