"""The audio front end of LTX-2 SFT (:mod:`miles_ltx.log_mel`) against its formulas:
the Slaney mel scale and filterbank, the spectrogram's frames and peak, FFT resampling."""

from __future__ import annotations

import math

import torch

from miles_ltx.log_mel import LOG_FLOOR, N_FFT, hz_to_slaney_mel, log_mel_spectrogram, mel_filterbank, resample, slaney_mel_to_hz


def test_the_slaney_scale_is_linear_below_1_khz_and_logarithmic_above() -> None:
    hz = torch.tensor([0.0, 200.0 / 3, 500.0, 1000.0, 6400.0], dtype=torch.float64)
    # 3 mels per 200 Hz below the knee; 27 mels per factor 6.4 above it (15 mels at 1 kHz).
    expected = torch.tensor([0.0, 1.0, 7.5, 15.0, 42.0], dtype=torch.float64)
    torch.testing.assert_close(hz_to_slaney_mel(hz), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(slaney_mel_to_hz(expected), hz, rtol=0, atol=1e-9)


def test_the_filterbank_has_unit_area_triangles_on_mel_spaced_edges() -> None:
    rate, n_mels = 16000, 64
    bank = mel_filterbank(rate, N_FFT, n_mels)
    assert bank.shape == (N_FFT // 2 + 1, n_mels) and bank.dtype == torch.float64 and bank.min() >= 0
    edges = slaney_mel_to_hz(
        torch.linspace(0, float(hz_to_slaney_mel(torch.tensor(rate / 2.0, dtype=torch.float64))), n_mels + 2, dtype=torch.float64)
    )
    freqs = torch.linspace(0, rate / 2, N_FFT // 2 + 1, dtype=torch.float64)
    for m in (0, 20, 63):
        left, centre, right = edges[m], edges[m + 1], edges[m + 2]
        outside = (freqs <= left) | (freqs >= right)
        assert torch.all(bank[outside, m] == 0)
        # Slaney normalisation: the triangle's peak is 2 / (right - left), so its area is 1.
        inside = freqs[~outside]
        triangle = torch.minimum((inside - left) / (centre - left), (right - inside) / (right - centre)) * 2 / (right - left)
        torch.testing.assert_close(bank[~outside, m], triangle, rtol=1e-12, atol=1e-15)


def test_a_tone_lights_the_mel_bin_around_its_frequency() -> None:
    rate, hop, n_mels, samples = 16000, 160, 64, 3200
    t = torch.arange(samples, dtype=torch.float64) / rate
    tone = torch.stack([torch.sin(2 * math.pi * 1000 * t), torch.zeros(samples, dtype=torch.float64)]).unsqueeze(0)
    mel = log_mel_spectrogram(tone, rate, hop, n_mels)
    assert mel.shape == (1, 2, 1 + samples // hop, n_mels) and mel.dtype == torch.float32
    edges = slaney_mel_to_hz(
        torch.linspace(0, float(hz_to_slaney_mel(torch.tensor(rate / 2.0, dtype=torch.float64))), n_mels + 2, dtype=torch.float64)
    )
    centre = int(torch.argmin((edges[1:-1] - 1000).abs()))
    assert int(mel[0, 0, 10].argmax()) == centre
    assert torch.all(mel[0, 1] == math.log(LOG_FLOOR))  # silence sits on the floor


def test_resampling_keeps_a_tone_and_the_duration() -> None:
    t = torch.arange(22050, dtype=torch.float64) / 22050  # one second, a whole number of periods
    out = resample(torch.sin(2 * math.pi * 440 * t).view(1, 1, -1), 22050, 16000)
    assert out.shape == (1, 1, 16000)
    expected = torch.sin(2 * math.pi * 440 * torch.arange(16000, dtype=torch.float64) / 16000).float()
    # Band-limited and periodic: the float64 FFT's rounding only (measured 3.7e-13 after the
    # cast to float32); 1e-6 leaves room for other FFT implementations.
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-6)
    assert torch.equal(resample(out, 16000, 16000), out)


def test_one_frame_equals_an_independent_numpy_computation() -> None:
    """The spectrogram's scale and framing, against numpy on one frame: reflect padding
    by n_fft / 2 (centred frames), a periodic Hann window, the real FFT's magnitude (not
    its power), the filterbank, the natural log over the floor. Power 2, log10 or
    uncentred frames would each miss by far more than the float32 STFT's rounding."""
    import numpy as np

    rate, hop, n_mels, samples, frame = 16000, 160, 64, 4000, 7
    signal = np.random.default_rng(0).standard_normal(samples) * 0.1 + np.sin(2 * np.pi * 440 * np.arange(samples) / rate)
    ours = log_mel_spectrogram(torch.from_numpy(signal).view(1, 1, -1), rate, hop, n_mels)[0, 0, frame].double().numpy()
    padded = np.pad(signal, N_FFT // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic: N in the denominator
    magnitude = np.abs(np.fft.rfft(padded[frame * hop : frame * hop + N_FFT] * window))
    expected = np.log(np.maximum(magnitude @ mel_filterbank(rate, N_FFT, n_mels).numpy(), LOG_FLOOR))
    assert expected.min() > math.log(LOG_FLOOR) + 1  # every bin above the floor: the scale is what is compared
    # float32 STFT against float64 numpy: measured max difference 1.4e-6 in log units (a
    # symmetric Hann window misses by 7e-3, power 2 by 5.3, log10 by 1.7, uncentred by 1.2).
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
