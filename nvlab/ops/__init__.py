"""Maintainer tools: executing notebooks and generating labs from solutions, offline wheelhouses."""
