"""The waveform side of LTX-2's audio VAE: resampling and the log-mel spectrogram its
encoder takes.

diffusers 0.42.1 ships the audio VAE's encoder (``AutoencoderKLLTX2Audio.encode``: a mel
spectrogram ``[B, channels, frames, mel_bins]`` to latents) and the vocoder (mel to
waveform), but not the front end that turns a waveform into that spectrogram. LTX-2's
front end is a magnitude mel spectrogram: a 1024-point STFT with a periodic Hann window of
the same length, centred frames (reflect padding), the audio VAE's hop length and mel bin
count, a Slaney-scale filterbank with Slaney (area) normalisation from 0 Hz to the Nyquist
frequency, then ``log(max(mel, 1e-5))``. This module computes exactly that in torch.

Resampling is an FFT resample: the real spectrum of the whole signal is truncated or
zero-padded to the new length and transformed back. It is band-limited but not
torchaudio's windowed-sinc resampler (whose output differs slightly, near the band edge
and at the ends); the signal is treated as periodic, so callers resample a little more
than they keep and drop the end, where the wrap-around lands.
"""

from __future__ import annotations

import math

import torch

N_FFT = 1024
"""LTX-2's STFT size (and window length)."""
LOG_FLOOR = 1e-5
"""The floor under the mel energies before the log."""

_SLANEY_LINEAR_HZ = 200.0 / 3.0  # Hz per mel below 1 kHz
_SLANEY_KNEE_HZ = 1000.0
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # mels are logarithmic above the knee


def hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    knee_mel = _SLANEY_KNEE_HZ / _SLANEY_LINEAR_HZ
    linear = hz / _SLANEY_LINEAR_HZ
    log = knee_mel + torch.log(torch.clamp(hz, min=_SLANEY_KNEE_HZ) / _SLANEY_KNEE_HZ) / _SLANEY_LOG_STEP
    return torch.where(hz >= _SLANEY_KNEE_HZ, log, linear)


def slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    knee_mel = _SLANEY_KNEE_HZ / _SLANEY_LINEAR_HZ
    linear = mel * _SLANEY_LINEAR_HZ
    log = _SLANEY_KNEE_HZ * torch.exp(_SLANEY_LOG_STEP * (mel - knee_mel))
    return torch.where(mel >= knee_mel, log, linear)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """``[n_fft // 2 + 1, n_mels]`` triangular filters, evenly spaced on the Slaney mel
    scale between 0 Hz and ``sample_rate / 2``, each scaled to unit area
    (``2 / (f_right − f_left)``). Computed in float64."""
    freqs = torch.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1, dtype=torch.float64)
    top = hz_to_slaney_mel(torch.tensor(sample_rate / 2.0, dtype=torch.float64))
    edges = slaney_mel_to_hz(torch.linspace(0.0, float(top), n_mels + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    offsets = edges.unsqueeze(0) - freqs.unsqueeze(1)  # [freqs, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return filters * (2.0 / (edges[2:] - edges[:-2])).unsqueeze(0)


def log_mel_spectrogram(waveform: torch.Tensor, sample_rate: int, hop_length: int, n_mels: int, n_fft: int = N_FFT) -> torch.Tensor:
    """``[B, channels, samples]`` to ``[B, channels, 1 + samples // hop_length, n_mels]``
    (the audio VAE's layout: time, then mel bins), in float32."""
    batch, channels, samples = waveform.shape
    flat = waveform.reshape(batch * channels, samples).float()
    window = torch.hann_window(n_fft, dtype=torch.float32, device=flat.device)
    spectrum = torch.stft(
        flat, n_fft=n_fft, hop_length=hop_length, win_length=n_fft, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    magnitude = spectrum.abs()  # [B * C, n_fft // 2 + 1, frames]
    filters = mel_filterbank(sample_rate, n_fft, n_mels).to(magnitude)
    mel = torch.matmul(magnitude.transpose(1, 2), filters)  # [B * C, frames, n_mels]
    return torch.log(torch.clamp(mel, min=LOG_FLOOR)).reshape(batch, channels, -1, n_mels)


def resample(waveform: torch.Tensor, source_rate: int, target_rate: int) -> torch.Tensor:
    """``[..., samples]`` at ``source_rate`` to ``round(samples · target / source)``
    samples at ``target_rate``, band-limited by FFT (see the module docstring)."""
    if source_rate == target_rate:
        return waveform.float()
    samples = waveform.shape[-1]
    out = max(1, round(samples * target_rate / source_rate))
    spectrum = torch.fft.rfft(waveform.double(), dim=-1)
    bins = out // 2 + 1
    kept = spectrum[..., : min(bins, spectrum.shape[-1])]
    if kept.shape[-1] < bins:
        kept = torch.nn.functional.pad(kept, (0, bins - kept.shape[-1]))
    return (torch.fft.irfft(kept, n=out, dim=-1) * (out / samples)).float()
