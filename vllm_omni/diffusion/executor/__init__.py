"""Executors: start a group of ranks (processes or Ray actors), hand them requests, watch their deadlines."""
