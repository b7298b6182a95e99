"""Data: corpora, windows and token directories (corpus), and `decoderlm prepare` (prepare)."""
