"""Lightning callbacks: cross-cutting concerns (CoPE targets, loss balance, logging, export) via public hooks."""
