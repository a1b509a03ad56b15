"""The benchmarks' library: reports.py (rows, results JSON, the docs writer, agreement), sp_forward.py (one forward
at SP degrees), e2e.py and video_e2e.py (pipeline calls end to end, timed by phase). Scripts import from here only."""
