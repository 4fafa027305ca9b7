"""Layers built on dispatch and combine: autograd functions and the expert-parallel MoE layer."""
