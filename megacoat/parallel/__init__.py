"""Parallelism: process groups (parallel state) and the functions that make the plain model tensor/pipeline parallel."""
