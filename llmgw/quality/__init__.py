"""Task quality: the corpora's tasks as validated objects, the scorers that grade an answer, and the
run that grades a candidate through a sandboxed gateway and writes its quality_gate record."""
