"""Maintainer tools: executing notebooks and generating labs from solutions, pacing, offline wheelhouses, the files the
version manifest decides, lab 09's question bank (`nvlab quiz`)."""
