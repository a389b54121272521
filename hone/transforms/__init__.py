"""Optimizations as composable transforms, applied by one planner in a fixed order."""
