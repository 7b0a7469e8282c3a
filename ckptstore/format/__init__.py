"""What the bytes are: the leaf schema (`leaves`), zarr3 chunks and zarr.json encoded and
decoded in Python (`chunks`), small leaves packed into one object per batch (`packs`), and
where each value of an OCDBT store lies (`ocdbt_index`)."""
