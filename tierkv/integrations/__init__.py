"""Adapters that put tierkv under outside engines; each module here is the only one importing its engine."""
