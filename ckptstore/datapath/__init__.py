"""The data path: a leaf's bytes written and read through TensorStore or the raw-key path
(`arrays`), packs of small leaves written and read (`packs`), where each value of an OCDBT
store lies in its data files, read straight from them (`ocdbt_index`), a leaf's regions read
chunk by chunk outside TensorStore (`rawleaf`), and restored host data placed onto devices
(`placement`)."""
