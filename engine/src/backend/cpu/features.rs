//! The one place that asks the CPU what it can do: every kernel family of the CPU backend picks
//! its instructions from [`features`] (detected once per process), and the packed matmul
//! kernels' choice is a [`Kernel`], which only this module makes.

/// The instruction-set extensions the CPU kernels use, as this CPU and OS offer them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub sse41: bool,
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vnni: bool,
    /// AMX-TILE and AMX-INT8 in CPUID, and the OS granted this process the tile state
    /// (`llmd_alloc_sys::request_tile_data`, asked once).
    pub amx: bool,
    /// aarch64's dot-product extension (`sdot`/`udot`).
    pub dotprod: bool,
}

impl Features {
    /// AVX2 with FMA and F16C: the AVX2 kernels (packed tiles, row dots, attention).
    pub fn avx2_fma_f16c(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// AVX-512 F/BW/VNNI with FMA and F16C: the AVX-512 packed kernels.
    pub fn avx512_vnni_kernels(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512vnni && self.fma && self.f16c
    }

    /// AVX-512 F/BW/VL: the AVX-512 activation quantizers.
    pub fn avx512_quantize(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512vl
    }

    fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let (avx512f, avx512bw, avx512vnni, fma, f16c) =
                (has!("avx512f"), has!("avx512bw"), has!("avx512vnni"), has!("fma"), has!("f16c"));
            // CPUID leaf 7, sub-leaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8. Asked only where the
            // AVX-512 kernels run (the AMX blocks live in them).
            let amx_cpuid = std::arch::x86_64::__cpuid(0).eax >= 7 && {
                let r = std::arch::x86_64::__cpuid_count(7, 0);
                r.edx & (1 << 24) != 0 && r.edx & (1 << 25) != 0
            };
            let avx512_kernels = avx512f && avx512bw && avx512vnni && fma && f16c;
            Features {
                sse41: has!("sse4.1"),
                avx2: has!("avx2"),
                fma,
                f16c,
                avx512f,
                avx512bw,
                avx512vl: has!("avx512vl"),
                avx512vnni,
                amx: avx512_kernels && amx_cpuid && llmd_alloc_sys::request_tile_data(),
                dotprod: false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            Features { dotprod: std::arch::is_aarch64_feature_detected!("dotprod"), ..Features::default() }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            Features::default()
        }
    }
}

/// This CPU's features, detected on first use.
pub fn features() -> &'static Features {
    static FEATURES: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    FEATURES.get_or_init(Features::detect)
}

/// The kernel families over the packed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    Scalar,
    Avx2,
    Avx512Vnni,
    /// AVX-512 VNNI, and AMX tiles for K-quant prompt chunks (`arch/x86/kpacked.rs`); everything else
    /// as [`KernelKind::Avx512Vnni`].
    Avx512Amx,
    NeonDotprod,
}

/// A kernel this CPU can run: only [`Kernel::available`] and [`Kernel::best`] make one, so
/// holding a `Kernel` proves its instructions were detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel(pub(super) KernelKind);

impl Kernel {
    pub fn kind(self) -> KernelKind {
        self.0
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            KernelKind::Scalar => "scalar",
            KernelKind::Avx2 => "avx2",
            KernelKind::Avx512Vnni => "avx512-vnni",
            KernelKind::Avx512Amx => "avx512-amx",
            KernelKind::NeonDotprod => "neon-dotprod",
        }
    }

    /// AVX-512 VNNI (with or without AMX): the x86 kernels that share one code path.
    pub fn is_avx512(self) -> bool {
        matches!(self.0, KernelKind::Avx512Vnni | KernelKind::Avx512Amx)
    }

    /// Every kernel this CPU runs, best first; the scalar reference is always last.
    pub fn available() -> Vec<Kernel> {
        let f = features();
        let mut v = Vec::new();
        if f.avx512_vnni_kernels() {
            if f.amx {
                v.push(Kernel(KernelKind::Avx512Amx));
            }
            v.push(Kernel(KernelKind::Avx512Vnni));
        }
        if f.avx2_fma_f16c() {
            v.push(Kernel(KernelKind::Avx2));
        }
        if f.dotprod {
            v.push(Kernel(KernelKind::NeonDotprod));
        }
        v.push(Kernel(KernelKind::Scalar));
        v
    }

    /// The best available kernel, or the one named by `LLMD_KERNEL` (`scalar`, `avx2`,
    /// `avx512-vnni`, `avx512-amx`, `neon-dotprod`) if this CPU has it. Chosen once per process.
    pub fn best() -> Kernel {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let all = Self::available();
            let wanted = std::env::var("LLMD_KERNEL").ok();
            wanted.and_then(|n| all.iter().copied().find(|k| k.name() == n)).unwrap_or(all[0])
        })
    }
}
