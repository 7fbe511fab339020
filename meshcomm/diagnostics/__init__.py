"""Diagnostics: the ledger, fingerprints, hang warnings and verdicts, and where each rank is."""
