"""Adapters that plug fmha into other libraries; each imports its library only when used."""
