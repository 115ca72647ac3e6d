"""Muon optimizer (Newton-Schulz orthogonalised momentum)."""
