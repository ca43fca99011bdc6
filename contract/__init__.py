"""The contracts between the parts that no part owns: what the export writes and the server reads."""
