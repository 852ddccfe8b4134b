"""kvscope.probe"""
