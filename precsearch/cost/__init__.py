"""Predicted bytes and peak of any assignment, and the measured peak they are checked against."""
