"""What the bytes are: the leaf schema (`leaves`), zarr3 chunks and zarr.json encoded and
decoded in Python (`chunks`), and what a pack of small leaves holds (`packs`). No I/O: the
data path reads and writes these bytes."""
