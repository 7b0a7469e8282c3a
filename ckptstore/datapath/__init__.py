"""The data path: a leaf's bytes written and read through TensorStore or the raw-key path
(`arrays`), a leaf's regions read chunk by chunk outside TensorStore (`rawleaf`), and
restored host data placed onto devices (`placement`)."""
