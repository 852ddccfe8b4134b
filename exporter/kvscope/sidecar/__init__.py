"""kvscope.sidecar"""
