//! The few CUDA driver API calls a GPU peer window needs, loaded at run time from
//! `libcuda.so.1` (the driver's library; no CUDA toolkit needed). Every call is checked;
//! a missing library or symbol is an error, never a panic.
//!
//! A window is device memory allocated with `cuMemAlloc`, marked with
//! `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` (what GPUDirect RDMA requires of memory a third-party
//! device reads and writes, so CUDA memory operations on it are synchronous), and, where the
//! driver supports it (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`, CUDA 11.7+, open kernel
//! modules), exported as a dma-buf file descriptor with `cuMemGetHandleForAddressRange`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::{Library, Symbol};

type CUresult = c_int;
type CUdevice = c_int;
type CUcontext = *mut c_void;
type CUdeviceptr = u64;

const CUDA_SUCCESS: CUresult = 0;
/// CUpointer_attribute: CU_POINTER_ATTRIBUTE_SYNC_MEMOPS.
const CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: c_int = 6;
/// CUdevice_attribute: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED.
const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// CUmemRangeHandleType: CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
/// The library the NVIDIA driver installs; `NACRE_HOST_LIBCUDA` overrides it.
pub const LIBCUDA: &str = "libcuda.so.1";

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "cannot load the CUDA driver library {lib}: {reason} (is the NVIDIA driver installed?)"
    )]
    NoLibrary { lib: String, reason: String },
    #[error("the CUDA driver library has no {0} (driver too old?)")]
    NoSymbol(&'static str),
    #[error("{call} failed: CUDA error {code} ({name})")]
    Call {
        call: &'static str,
        code: i32,
        name: String,
    },
    #[error("{0}")]
    Other(String),
}

/// The loaded driver library.
pub struct Cuda {
    lib: Library,
}

/// A GPU as CUDA sees it.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    pub handle: CUdevice,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and nvidia-smi print it.
    pub uuid: String,
    /// `0000:3b:00.0`.
    pub bdf: String,
    pub dma_buf: bool,
}

/// Format CUDA's 16-byte UUID the way NVML does.
pub fn format_gpu_uuid(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

impl Cuda {
    /// Load the driver library (`NACRE_HOST_LIBCUDA` or [`LIBCUDA`]) and `cuInit` it.
    pub fn load() -> Result<Self, CudaError> {
        let lib = std::env::var("NACRE_HOST_LIBCUDA").unwrap_or_else(|_| LIBCUDA.into());
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which have no
        // preconditions on our side.
        let l = unsafe { Library::new(&lib) }.map_err(|e| CudaError::NoLibrary {
            lib: lib.clone(),
            reason: e.to_string(),
        })?;
        let c = Cuda { lib: l };
        // SAFETY: cuInit(unsigned int flags), flags must be 0.
        c.check("cuInit", unsafe {
            c.sym::<unsafe extern "C" fn(c_uint) -> CUresult>(b"cuInit\0")?(0)
        })?;
        Ok(c)
    }

    fn sym<T>(&self, name: &'static [u8]) -> Result<Symbol<'_, T>, CudaError> {
        // SAFETY: each caller names a symbol with the C signature CUDA's cuda.h gives it.
        unsafe { self.lib.get::<T>(name) }.map_err(|_| {
            CudaError::NoSymbol(std::str::from_utf8(&name[..name.len() - 1]).unwrap_or("?"))
        })
    }

    fn check(&self, call: &'static str, r: CUresult) -> Result<(), CudaError> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let mut s: *const c_char = std::ptr::null();
        let name = match self.sym::<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>(
            b"cuGetErrorName\0",
        ) {
            // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
            Ok(f) if unsafe { f(r, &mut s) } == CUDA_SUCCESS && !s.is_null() => {
                // SAFETY: the driver returned a NUL-terminated static string.
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            }
            _ => "unknown".into(),
        };
        Err(CudaError::Call {
            call,
            code: r,
            name,
        })
    }

    /// Every GPU the driver exposes.
    pub fn devices(&self) -> Result<Vec<CudaDevice>, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: cuDeviceGetCount(int*), a valid out pointer.
        self.check("cuDeviceGetCount", unsafe {
            self.sym::<unsafe extern "C" fn(*mut c_int) -> CUresult>(b"cuDeviceGetCount\0")?(&mut n)
        })?;
        let get =
            self.sym::<unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult>(b"cuDeviceGet\0")?;
        let uuid = self.sym::<unsafe extern "C" fn(*mut [u8; 16], CUdevice) -> CUresult>(
            b"cuDeviceGetUuid\0",
        )?;
        let bus = self.sym::<unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult>(
            b"cuDeviceGetPCIBusId\0",
        )?;
        let attr = self.sym::<unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CUresult>(
            b"cuDeviceGetAttribute\0",
        )?;
        let mut out = Vec::new();
        for ordinal in 0..n {
            let mut h: CUdevice = 0;
            // SAFETY: valid out pointer, ordinal below the count.
            self.check("cuDeviceGet", unsafe { get(&mut h, ordinal) })?;
            let mut u = [0u8; 16];
            // SAFETY: CUuuid is 16 bytes; valid out pointer.
            self.check("cuDeviceGetUuid", unsafe { uuid(&mut u, h) })?;
            let mut b = [0 as c_char; 32];
            // SAFETY: the buffer holds 32 bytes and we pass its length.
            self.check("cuDeviceGetPCIBusId", unsafe { bus(b.as_mut_ptr(), 32, h) })?;
            // SAFETY: the driver NUL-terminates within the length given.
            let bdf = unsafe { CStr::from_ptr(b.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            let mut dma: c_int = 0;
            // SAFETY: valid out pointer; an unknown attribute is an error we treat as "no".
            let dma_ok = unsafe { attr(&mut dma, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, h) };
            out.push(CudaDevice {
                handle: h,
                uuid: format_gpu_uuid(&u),
                bdf: crate::topology::normalize_bdf(&bdf),
                dma_buf: dma_ok == CUDA_SUCCESS && dma != 0,
            });
        }
        Ok(out)
    }
}

/// A pinned buffer on one GPU; freed (and its dma-buf closed) when dropped.
pub struct GpuBuffer<'a> {
    cuda: &'a Cuda,
    dev: CUdevice,
    ctx: CUcontext,
    pub ptr: u64,
    pub len: u64,
    /// The dma-buf fd, when the driver could export one.
    pub dmabuf: Option<i32>,
}

impl Cuda {
    /// Allocate `len` bytes (rounded up to 2 MiB, the GPU's large page) on `d`, make its
    /// memory operations synchronous for peer access, and export a dma-buf if supported.
    pub fn alloc_window(&self, d: &CudaDevice, len: u64) -> Result<GpuBuffer<'_>, CudaError> {
        const PAGE: u64 = 2 << 20;
        let len = len
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| CudaError::Other("size too large".into()))?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer and a device handle from cuDeviceGet.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            self.sym::<unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult>(
                b"cuDevicePrimaryCtxRetain\0",
            )?(&mut ctx, d.handle)
        })?;
        let mut buf = GpuBuffer {
            cuda: self,
            dev: d.handle,
            ctx,
            ptr: 0,
            len,
            dmabuf: None,
        };
        // SAFETY: a context just retained.
        self.check("cuCtxSetCurrent", unsafe {
            self.sym::<unsafe extern "C" fn(CUcontext) -> CUresult>(b"cuCtxSetCurrent\0")?(ctx)
        })?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: valid out pointer; the current context is set.
        self.check("cuMemAlloc", unsafe {
            self.sym::<unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult>(
                b"cuMemAlloc_v2\0",
            )?(&mut p, len as usize)
        })?;
        buf.ptr = p;
        let one: c_uint = 1;
        // SAFETY: the attribute takes a pointer to an unsigned int flag; p is ours.
        self.check("cuPointerSetAttribute(SYNC_MEMOPS)", unsafe {
            self.sym::<unsafe extern "C" fn(*const c_void, c_int, CUdeviceptr) -> CUresult>(
                b"cuPointerSetAttribute\0",
            )?(
                &one as *const c_uint as *const c_void,
                CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                p,
            )
        })?;
        if d.dma_buf {
            let mut fd: c_int = -1;
            if let Ok(f) = self.sym::<unsafe extern "C" fn(
                *mut c_void,
                CUdeviceptr,
                usize,
                c_int,
                u64,
            ) -> CUresult>(b"cuMemGetHandleForAddressRange\0")
            {
                // SAFETY: the handle out parameter is an int for DMA_BUF_FD; the range is
                // the allocation itself.
                let r = unsafe {
                    f(
                        &mut fd as *mut c_int as *mut c_void,
                        p,
                        len as usize,
                        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                        0,
                    )
                };
                if r == CUDA_SUCCESS && fd >= 0 {
                    buf.dmabuf = Some(fd);
                }
            }
        }
        Ok(buf)
    }
}

impl Drop for GpuBuffer<'_> {
    fn drop(&mut self) {
        if let Some(fd) = self.dmabuf.take() {
            // SAFETY: the fd came from the driver and is closed once.
            unsafe { libc::close(fd) };
        }
        if self.ptr != 0 {
            if let Ok(f) = self
                .cuda
                .sym::<unsafe extern "C" fn(CUdeviceptr) -> CUresult>(b"cuMemFree_v2\0")
            {
                // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
                unsafe { f(self.ptr) };
            }
        }
        if !self.ctx.is_null() {
            if let Ok(f) = self.cuda.sym::<unsafe extern "C" fn(CUdevice) -> CUresult>(
                b"cuDevicePrimaryCtxRelease_v2\0",
            ) {
                // SAFETY: releases the retain made in alloc_window.
                unsafe { f(self.dev) };
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn gpu_uuids_print_like_nvml() {
        let b = [
            0x5f, 0x0c, 0x9a, 0x3e, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23,
            0x45, 0x67,
        ];
        assert_eq!(
            format_gpu_uuid(&b),
            "GPU-5f0c9a3e-1234-5678-9abc-def001234567"
        );
    }

    #[test]
    fn a_missing_driver_library_is_an_error() {
        std::env::set_var("NACRE_HOST_LIBCUDA", "/nonexistent/libcuda.so.1");
        let e = Cuda::load().err().expect("no driver here");
        assert!(matches!(e, CudaError::NoLibrary { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/libcuda.so.1"), "{e}");
    }
}
