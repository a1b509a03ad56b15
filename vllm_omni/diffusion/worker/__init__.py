"""What one rank runs: its load, its request loop, the one runner for every family and the speed levers."""
