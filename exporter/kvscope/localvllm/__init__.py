"""kvscope.localvllm"""
