"""Importers: bring models saved in other formats into ckptstore checkpoints."""
