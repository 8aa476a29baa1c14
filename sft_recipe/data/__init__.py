"""Data: read the splits (prepare), recognise and convert their format for TRL (formats), check every row (checks),
measure what will be trained (report) -- all before any weight is loaded."""
