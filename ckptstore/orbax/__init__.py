"""Orbax checkpoints, the whole feature: reading one in place (`read`), inspecting and
verifying it (`inspect`), importing it as a ckptstore step (`importer`) and exporting a
step as one (`exporter`, with the metadata it writes in `metadata`)."""
