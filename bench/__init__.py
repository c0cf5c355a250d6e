"""In-repo benchmark: `make bench` / `python -m bench`."""
