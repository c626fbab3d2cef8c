"""Turns an edge-dialect ExportedProgram into an etmlx Graph."""
