"""Model building blocks: linear layers with a tensor-parallel-ready weight loader,
embeddings, norms, rotary embedding, activations."""
