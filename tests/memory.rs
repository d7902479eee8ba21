//! The memory layer on every device: buffers of every resource, copies, slices, ownership, the
//! pinned pool, arrow buffers, strided views and host registration.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow_cuda::memory::pinned::PinnedPool;
use arrow_cuda::memory::{Element, StridedView, c_strides, register, register_mut};
use arrow_cuda::{Device, DeviceBuffer, Error, MemoryResource, Stream};
use half::f16;

/// Every resource whose memory lives on `device` (host memory only on the CPU).
fn resources(device: Device) -> Vec<MemoryResource> {
    match device {
        Device::Cpu => vec![MemoryResource::Host],
        Device::Cuda(o) => vec![
            MemoryResource::DevicePool(o),
            MemoryResource::Device(o),
            MemoryResource::PinnedHost(o),
            MemoryResource::WriteCombinedHost(o),
            MemoryResource::Managed(o),
        ],
        other => panic!("each_device gave {other}"),
    }
}

/// The resources a case on `device` copies between: its own and the host's.
fn with_host(device: Device) -> Vec<MemoryResource> {
    let mut r = resources(device);
    if !r.contains(&MemoryResource::Host) {
        r.push(MemoryResource::Host);
    }
    r
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Zeroed memory of `resource`. Host memory comes zeroed from its allocation, so the cases that copy
/// between resources do not depend on `fill` of host memory on a CUDA stream, which
/// `fill_sets_every_byte` tests on its own.
fn zeroed(resource: MemoryResource, len: usize, stream: &Stream) -> DeviceBuffer {
    if resource == MemoryResource::Host {
        let b = DeviceBuffer::alloc(resource, len, stream).unwrap();
        assert!(b.host_slice().unwrap().iter().all(|&x| x == 0));
        b
    } else {
        DeviceBuffer::zeroed(resource, len, stream).unwrap()
    }
}

fn gpu_machine() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

// --- buffers -----------------------------------------------------------------------------------

#[test]
fn alloc_zeroed_from_host_and_to_vec_round_trip() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            for len in [0usize, 1, 7, 64, 4096, (1 << 20) + 3] {
                let data = pattern(len, 3);
                let b = DeviceBuffer::from_host(&data, resource, stream).unwrap();
                assert_eq!(b.len(), len);
                assert_eq!(b.is_empty(), len == 0);
                assert_eq!(b.resource(), resource);
                assert_eq!(b.device(), resource.device());
                assert_eq!(b.is_host_accessible(), resource.device().is_host_accessible());
                assert_eq!(b.to_vec(stream).unwrap(), data, "{resource:?} {len}");
                assert!(b.is_mutable());
                assert!(b.parent().is_none());

                let z = DeviceBuffer::zeroed(resource, len, stream).unwrap();
                assert_eq!(z.len(), len);
                assert!(z.to_vec(stream).unwrap().iter().all(|&x| x == 0), "{resource:?} {len}");

                let a = DeviceBuffer::alloc(resource, len, stream).unwrap();
                assert_eq!(a.len(), len);
                assert_eq!(a.to_vec(stream).unwrap().len(), len);
                assert_eq!(
                    a.address() % arrow_cuda::memory::ALIGNMENT as u64,
                    0,
                    "{resource:?} {len}"
                );
                if let Some(host) = b.host_slice() {
                    assert_eq!(host, &data[..]);
                } else {
                    assert!(matches!(device, Device::Cuda(_)) && !resource.device().is_host_accessible());
                }
            }
        }
    });
}

#[test]
fn copy_to_host_and_from_host_at_positions() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let mut b = DeviceBuffer::zeroed(resource, 100, stream).unwrap();
            let src: Vec<u8> = (1..=20).collect();
            b.copy_from_host(10, &src, stream).unwrap();
            let mut expected = vec![0u8; 100];
            expected[10..30].copy_from_slice(&src);
            assert_eq!(b.to_vec(stream).unwrap(), expected);

            let mut out = vec![0xffu8; 30];
            b.copy_to_host(5, &mut out, stream).unwrap();
            assert_eq!(out, expected[5..35]);
            b.copy_to_host(100, &mut [], stream).unwrap();
            b.copy_from_host(100, &[], stream).unwrap();

            let err = b.copy_from_host(90, &src, stream).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        offset: 90,
                        len: 20,
                        size: 100
                    }
                ),
                "{err}"
            );
            let err = b.copy_to_host(101, &mut [], stream).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        offset: 101,
                        len: 0,
                        size: 100
                    }
                ),
                "{err}"
            );
            let err = b.copy_to_host(usize::MAX, &mut [0u8; 2], stream).unwrap_err();
            assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
            // Nothing was written by the failed copies.
            assert_eq!(b.to_vec(stream).unwrap(), expected);
        }
    });
}

#[test]
fn async_host_copies_complete_by_their_event() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data = pattern(5000, 9);
            let mut b = DeviceBuffer::zeroed(resource, 6000, stream).unwrap();
            // SAFETY: `data` is neither written nor dropped before the event is waited on.
            let done = unsafe { b.copy_from_host_async(1000, &data, stream) }.unwrap();
            done.synchronize().unwrap();
            assert!(done.is_complete().unwrap());
            let mut out = vec![0u8; 5000];
            // SAFETY: `out` is read only after the event completes.
            let done = unsafe { b.copy_to_host_async(1000, &mut out, stream) }.unwrap();
            done.synchronize().unwrap();
            assert_eq!(out, data);
        }
    });
}

#[test]
fn copy_from_between_every_pair_of_resources() {
    common::each_device(|device, stream| {
        let all = with_host(device);
        for &from in &all {
            for &to in &all {
                let data = pattern(3000, 1);
                let src = DeviceBuffer::from_host(&data, from, stream).unwrap();
                let mut dst = zeroed(to, 3010, stream);
                dst.copy_from(7, &src, stream).unwrap();
                let got = dst.to_vec(stream).unwrap();
                assert!(got[..7].iter().all(|&x| x == 0), "{from:?} -> {to:?}");
                assert_eq!(got[7..3007], data[..], "{from:?} -> {to:?}");
                assert!(got[3007..].iter().all(|&x| x == 0), "{from:?} -> {to:?}");

                let err = dst.copy_from(11, &src, stream).unwrap_err();
                assert!(
                    matches!(
                        err,
                        Error::OutOfBounds {
                            offset: 11,
                            len: 3000,
                            size: 3010
                        }
                    ),
                    "{err}"
                );

                let copy = src.copy_to(to, stream).unwrap();
                assert_eq!(copy.resource(), to);
                assert!(!copy.shares_allocation(&src));
                assert!(copy.equals(&src, stream).unwrap(), "{from:?} -> {to:?}");

                // SAFETY: both buffers stay alive and `dst` unread until the event completes.
                let done = unsafe { dst.copy_from_async(0, &src, stream) }.unwrap();
                done.synchronize().unwrap();
                assert_eq!(dst.to_vec(stream).unwrap()[..3000], data[..]);
            }
        }
    });
}

#[test]
fn fill_sets_every_byte() {
    common::each_device(|device, stream| {
        // Host memory too: on a CUDA stream, pageable memory cannot be set by the driver.
        for resource in with_host(device) {
            let mut b = DeviceBuffer::alloc(resource, 1000, stream).unwrap();
            b.fill(0xa5, stream)
                .unwrap_or_else(|e| panic!("{resource:?} on {device}: {e}"));
            assert_eq!(b.to_vec(stream).unwrap(), vec![0xa5; 1000]);
            let z =
                DeviceBuffer::zeroed(resource, 10, stream).unwrap_or_else(|e| panic!("{resource:?} on {device}: {e}"));
            assert_eq!(z.to_vec(stream).unwrap(), vec![0; 10]);
        }
    });
}

// --- slices and ownership ----------------------------------------------------------------------

#[test]
fn slices_share_the_allocation_and_outlive_their_parent() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data = pattern(100, 5);
            let buf = DeviceBuffer::from_host(&data, resource, stream).unwrap();
            let s = buf.slice(10, 20).unwrap();
            assert_eq!(s.len(), 20);
            assert_eq!(s.offset(), 10);
            assert_eq!(s.address(), buf.address() + 10);
            assert!(s.shares_allocation(&buf));
            let parent = s.parent().expect("a part of an allocation has a parent");
            assert_eq!((parent.address(), parent.len()), (buf.address(), buf.len()));
            assert!(parent.shares_allocation(&buf));
            drop(parent);
            let ss = s.slice(5, 10).unwrap();
            assert_eq!(ss.offset(), 15);
            assert_eq!(ss.to_vec(stream).unwrap(), data[15..25]);
            assert!(buf.slice(100, 0).unwrap().is_empty());

            // While several views live, none is mutable and writes fail.
            assert!(!buf.is_mutable());
            let mut s2 = s.clone();
            assert!(!s2.is_mutable());
            let err = s2.copy_from_host(0, &[1, 2, 3], stream).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{err}");
            assert!(matches!(s2.fill(0, stream).unwrap_err(), Error::Unsupported(_)));
            drop(s2);

            let err = buf.slice(90, 20).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        offset: 90,
                        len: 20,
                        size: 100
                    }
                ),
                "{err}"
            );
            assert!(matches!(
                buf.slice(usize::MAX, 2).unwrap_err(),
                Error::OutOfBounds { .. }
            ));
            assert!(matches!(
                s.slice(15, 6).unwrap_err(),
                Error::OutOfBounds {
                    offset: 15,
                    len: 6,
                    size: 20
                }
            ));

            // The slice keeps the memory alive after the parent and its other views drop.
            drop(ss);
            drop(buf);
            assert_eq!(s.to_vec(stream).unwrap(), data[10..30]);
            assert_eq!(s.parent().unwrap().to_vec(stream).unwrap(), data);
            // The last view of an allocation is mutable again.
            let mut s = s;
            assert!(s.is_mutable());
            s.copy_from_host(0, &[9; 20], stream).unwrap();
            assert_eq!(s.to_vec(stream).unwrap(), vec![9; 20]);
        }
    });
}

#[test]
fn equals_and_to_hex() {
    common::each_device(|device, stream| {
        let all = with_host(device);
        for &r in &all {
            let a = DeviceBuffer::from_host(&[0x00, 0xab, 0x10], r, stream).unwrap();
            assert_eq!(a.to_hex(stream).unwrap(), "00ab10");
            assert!(a.equals(&a, stream).unwrap());
            assert!(a.equals(&a.clone(), stream).unwrap());
            for &q in &all {
                let same = DeviceBuffer::from_host(&[0x00, 0xab, 0x10], q, stream).unwrap();
                let other = DeviceBuffer::from_host(&[0x00, 0xab, 0x11], q, stream).unwrap();
                let shorter = DeviceBuffer::from_host(&[0x00, 0xab], q, stream).unwrap();
                assert!(a.equals(&same, stream).unwrap(), "{r:?} {q:?}");
                assert!(!a.equals(&other, stream).unwrap(), "{r:?} {q:?}");
                assert!(!a.equals(&shorter, stream).unwrap(), "{r:?} {q:?}");
            }
            let empty = DeviceBuffer::alloc(r, 0, stream).unwrap();
            assert_eq!(empty.to_hex(stream).unwrap(), "");
        }
    });
}

/// Owns a host vector and counts how often it is dropped.
struct CountingOwner {
    _data: Vec<u8>,
    drops: Arc<AtomicUsize>,
}

impl Drop for CountingOwner {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn from_raw_parts_drops_its_owner_exactly_once() {
    let drops = Arc::new(AtomicUsize::new(0));
    let data = pattern(256, 2);
    let owner = CountingOwner {
        _data: data.clone(),
        drops: drops.clone(),
    };
    let owned_address = owner._data.as_ptr() as u64;
    // SAFETY: the owner keeps its vector alive and nobody writes it.
    let b = unsafe { DeviceBuffer::from_raw_parts(owned_address, 256, Device::Cpu, owner) };
    assert_eq!(b.resource(), MemoryResource::Foreign(Device::Cpu));
    assert_eq!(b.host_slice().unwrap(), &data[..]);
    assert!(!b.is_mutable(), "foreign memory is never written through safe methods");
    let s = b.slice(10, 10).unwrap();
    let c = b.clone();
    let arrow = b.to_arrow_buffer().unwrap();
    drop(b);
    drop(c);
    drop(s);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "an arrow buffer still holds the memory"
    );
    assert_eq!(arrow.as_slice(), &data[..]);
    drop(arrow);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn into_raw_parts_and_back() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data = pattern(1000, 4);
            let b = DeviceBuffer::from_host(&data, resource, stream)
                .unwrap()
                .slice(100, 800)
                .unwrap();
            let address = b.address();
            let (a, len, owner) = b.into_raw_parts();
            assert_eq!((a, len), (address, 800));
            // SAFETY: the owner is the buffer itself, which keeps the memory valid.
            let wrapped = unsafe { DeviceBuffer::from_raw_parts(a, len, resource.device(), owner) };
            assert_eq!(wrapped.device(), resource.device());
            assert_eq!(wrapped.to_vec(stream).unwrap(), data[100..900]);
        }
    });
}

#[test]
fn free_on_keeps_other_views_and_frees_the_last() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data = pattern(4096, 6);
            let b = DeviceBuffer::from_host(&data, resource, stream).unwrap();
            let keep = b.slice(0, 4096).unwrap();
            b.free_on(stream);
            assert!(keep.is_mutable(), "free_on gave up its view");
            assert_eq!(keep.to_vec(stream).unwrap(), data);
            keep.free_on(stream);
            stream.synchronize().unwrap();
            // The memory can be allocated again and used.
            let again = DeviceBuffer::from_host(&data, resource, stream).unwrap();
            assert_eq!(again.to_vec(stream).unwrap(), data);
        }
    });
}

#[test]
fn to_arrow_buffer_is_zero_copy_on_host_memory_and_refused_on_the_device() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data = pattern(333, 8);
            let b = DeviceBuffer::from_host(&data, resource, stream).unwrap();
            if resource.device().is_host_accessible() {
                let arrow = b.to_arrow_buffer().unwrap();
                assert_eq!(arrow.as_ptr() as u64, b.address(), "{resource:?}: no copy");
                assert_eq!(arrow.len(), 333);
                let slice = b.slice(3, 30).unwrap().to_arrow_buffer().unwrap();
                assert_eq!(slice.as_slice(), &data[3..33]);
                drop(b);
                assert_eq!(
                    arrow.as_slice(),
                    &data[..],
                    "{resource:?}: the arrow buffer keeps the memory"
                );
            } else {
                let err = b.to_arrow_buffer().unwrap_err();
                assert!(matches!(err, Error::Unsupported(_)), "{err}");
            }
        }
    });
}

// --- pinned pool -------------------------------------------------------------------------------

#[test]
fn pinned_pool_refuses_memory_that_is_not_pinned() {
    let err = PinnedPool::shared(MemoryResource::Host).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = PinnedPool::shared(MemoryResource::Device(0)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn pinned_pool_reuses_blocks() {
    let Some(gpu) = common::cuda() else { return };
    let ordinal = gpu.ordinal().unwrap();
    for resource in [
        MemoryResource::PinnedHost(ordinal),
        MemoryResource::WriteCombinedHost(ordinal),
    ] {
        let pool = Arc::new(PinnedPool::new(resource));
        let stream = Stream::cpu();
        let mut a = pool.take(100_000).unwrap();
        assert_eq!(a.len(), 100_000);
        assert_eq!(a.resource(), resource);
        assert_eq!(a.device(), Device::CudaHost(ordinal));
        assert!(a.is_mutable());
        a.copy_from_host(0, &pattern(100_000, 1), &stream).unwrap();
        let address = a.address();
        assert_eq!(pool.cached_bytes(), 0);
        drop(a);
        let cached = pool.cached_bytes();
        assert!(cached >= 100_000, "the block went back to the pool ({cached})");

        let b = pool.take(100_000).unwrap();
        assert_eq!(b.address(), address, "the same block is handed back");
        assert_eq!(pool.cached_bytes(), 0);
        // An arrow buffer made from pooled memory keeps the block out of the pool.
        let arrow = b.to_arrow_buffer().unwrap();
        drop(b);
        assert_eq!(pool.cached_bytes(), 0);
        drop(arrow);
        assert_eq!(pool.cached_bytes(), cached);

        let c = pool.take(3 << 20).unwrap();
        assert_ne!(c.address(), address, "a larger size class is a new block");
        drop(c);
        assert!(pool.cached_bytes() >= cached + (3 << 20));
        pool.trim();
        assert_eq!(pool.cached_bytes(), 0);

        pool.set_cache_limit(0);
        drop(pool.take(10).unwrap());
        assert_eq!(pool.cached_bytes(), 0, "nothing is cached beyond the limit");
        pool.set_cache_limit(1 << 30);
        drop(pool.take(10).unwrap());
        let small = pool.cached_bytes();
        assert!(small > 0);
        pool.set_cache_limit(small - 1);
        assert_eq!(pool.cached_bytes(), 0, "lowering the limit frees blocks");

        // Dropping the pool before its buffers frees their blocks instead of caching them.
        let d = pool.take(4096).unwrap();
        drop(pool);
        assert_eq!(d.len(), 4096);
        drop(d);
    }
}

// --- device pointers and registration ----------------------------------------------------------

#[test]
fn device_pointers_of_each_resource() {
    common::each_device(|device, stream| {
        for resource in with_host(device) {
            let b = DeviceBuffer::from_host(&pattern(4096, 1), resource, stream).unwrap();
            match resource {
                MemoryResource::Host => {
                    assert!(matches!(b.device_pointer().unwrap_err(), Error::Unsupported(_)));
                }
                MemoryResource::DevicePool(_) | MemoryResource::Device(_) | MemoryResource::Managed(_) => {
                    assert_eq!(b.device_pointer().unwrap(), b.address());
                }
                _ => {
                    let p = b.device_pointer().unwrap();
                    assert_ne!(p, 0);
                    let s = b.slice(100, 10).unwrap();
                    assert_eq!(s.device_pointer().unwrap(), p + 100);
                    // Device work reaches the bytes through the mapping: wrap it as device memory and copy.
                    let ordinal = resource.device().ordinal().unwrap();
                    // SAFETY: the mapping stays valid while `b` lives (the owner holds a view of it).
                    let mapped = unsafe { DeviceBuffer::from_raw_parts(p, 4096, Device::Cuda(ordinal), b.clone()) };
                    assert_eq!(mapped.to_vec(stream).unwrap(), pattern(4096, 1));
                }
            }
        }
    });
}

#[test]
fn registration_pins_host_memory_for_a_scope() {
    let Some(gpu) = common::cuda() else { return };
    let ordinal = gpu.ordinal().unwrap();
    let stream = Stream::new(gpu).unwrap();
    let data = pattern(1 << 20, 7);
    {
        let r = register(&data, ordinal).unwrap();
        assert_eq!(r.len(), 1 << 20);
        assert_eq!(r.host_slice(), &data[..]);
        assert_eq!(r.device(), Device::CudaHost(ordinal));
        let dptr = r.device_pointer().unwrap();
        assert_ne!(dptr, 0);
        // The device reaches the registered bytes through the mapping.
        // SAFETY: the registration outlives the wrapper, which is dropped inside this scope.
        let mapped = unsafe { DeviceBuffer::from_raw_parts(dptr, 1 << 20, gpu, ()) };
        let on_device = mapped.copy_to(MemoryResource::Device(ordinal), &stream).unwrap();
        assert_eq!(on_device.to_vec(&stream).unwrap(), data);
        drop(mapped);
    }
    // Unregistered on drop: it can be registered again.
    drop(register(&data, ordinal).unwrap());

    let mut target = vec![0u8; 1 << 20];
    {
        let mut r = register_mut(&mut target, ordinal).unwrap();
        let src = DeviceBuffer::from_host(&data, MemoryResource::DevicePool(ordinal), &stream).unwrap();
        src.copy_to_host(0, r.host_slice_mut(), &stream).unwrap();
        assert_eq!(r.host_slice(), &data[..]);
        r.host_slice_mut()[0] = 0;
        assert!(!r.is_empty());
        assert_ne!(r.device_pointer().unwrap(), 0);
    }
    assert_eq!(target[0], 0);
    assert_eq!(target[1..], data[1..]);

    let empty = register(&[], ordinal).unwrap();
    assert!(empty.is_empty());
}

// --- errors without a driver, and out of memory ------------------------------------------------

#[test]
fn cuda_devices_lists_gpus_or_says_what_was_looked_for() {
    match arrow_cuda::device::cuda_devices() {
        Ok(devices) => {
            assert!(gpu_machine() || !devices.is_empty());
            assert!(!devices.is_empty());
            for d in &devices {
                assert!(!d.name.is_empty());
                assert!(d.total_memory > 0);
            }
        }
        Err(e) => {
            assert!(!gpu_machine(), "this machine has a GPU but cuda_devices failed: {e}");
            match &e {
                Error::NoDriver { looked_for } => {
                    assert!(looked_for.contains("cuda"), "{looked_for}");
                    assert!(e.to_string().contains(looked_for.as_str()), "{e}");
                }
                Error::NoDevice { .. } => {}
                other => panic!("unexpected error without a GPU: {other}"),
            }
        }
    }
}

#[test]
fn without_a_gpu_cuda_memory_is_an_error_not_a_panic() {
    if arrow_cuda::device::cuda_available() {
        return;
    }
    let stream = Stream::cpu();
    for resource in [
        MemoryResource::DevicePool(0),
        MemoryResource::Device(0),
        MemoryResource::PinnedHost(0),
        MemoryResource::WriteCombinedHost(0),
        MemoryResource::Managed(0),
    ] {
        assert!(DeviceBuffer::alloc(resource, 16, &stream).is_err(), "{resource:?}");
        assert!(
            DeviceBuffer::from_host(&[1, 2, 3], resource, &stream).is_err(),
            "{resource:?}"
        );
    }
    assert!(Stream::new(Device::Cuda(0)).is_err());
    assert!(register(&[1, 2, 3], 0).is_err());
    assert!(register_mut(&mut [1, 2, 3], 0).is_err());
    assert!(
        Arc::new(PinnedPool::new(MemoryResource::PinnedHost(0)))
            .take(10)
            .is_err()
    );
    // An empty buffer needs no driver to exist, but its device pointer does.
    let empty = DeviceBuffer::alloc(MemoryResource::PinnedHost(0), 0, &stream).unwrap();
    assert!(empty.device_pointer().is_err());
}

#[test]
fn a_petabyte_is_out_of_memory() {
    let Some(gpu) = common::cuda() else { return };
    if common::under_sanitizer() {
        eprintln!("skipped under compute-sanitizer: the failed allocation is deliberate");
        return;
    }
    let ordinal = gpu.ordinal().unwrap();
    let stream = Stream::new(gpu).unwrap();
    for resource in [
        MemoryResource::Device(ordinal),
        MemoryResource::DevicePool(ordinal),
        MemoryResource::PinnedHost(ordinal),
    ] {
        let err = DeviceBuffer::alloc(resource, 1 << 50, &stream).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { requested, .. } if requested == 1 << 50),
            "{resource:?}: {err}"
        );
    }
    // The device is still usable afterwards.
    let b = DeviceBuffer::from_host(&[1, 2, 3], MemoryResource::Device(ordinal), &stream).unwrap();
    assert_eq!(b.to_vec(&stream).unwrap(), [1, 2, 3]);
}

/// Pinned memory of every size (a page's worth and less, several pages, past a huge page) comes
/// zeroed, mapped into the device's address space, and copies both ways.
#[test]
fn pinned_memory_comes_zeroed_and_mapped() {
    let Some(gpu) = common::cuda() else { return };
    let ordinal = gpu.ordinal().unwrap();
    let stream = Stream::new(gpu).unwrap();
    for len in [1, 4096, 12_345, (2 << 20) + 1, 5 << 20] {
        let mut pinned = DeviceBuffer::alloc(MemoryResource::PinnedHost(ordinal), len, &stream).unwrap();
        assert_eq!(pinned.len(), len);
        assert!(pinned.host_slice().unwrap().iter().all(|&b| b == 0), "{len}");
        assert!(pinned.device_pointer().is_ok(), "{len}");
        let data = pattern(len, 7);
        pinned.host_slice_mut().unwrap().copy_from_slice(&data);
        let device = pinned.copy_to(MemoryResource::Device(ordinal), &stream).unwrap();
        let back = device.copy_to(MemoryResource::PinnedHost(ordinal), &stream).unwrap();
        assert_eq!(back.host_slice().unwrap(), &data[..], "{len}");
    }
}

// --- strided views -----------------------------------------------------------------------------

#[test]
fn contiguous_views() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let data: Vec<f32> = (0..12).map(|i| i as f32 * 1.5).collect();
            let v = StridedView::from_host(&data, &[4, 3], resource, stream).unwrap();
            assert_eq!(v.shape(), &[4, 3]);
            assert_eq!(v.strides(), &[12, 4]);
            assert_eq!((v.len(), v.ndim(), v.byte_offset()), (12, 2, 0));
            assert!(v.is_contiguous());
            assert_eq!(v.device(), resource.device());
            assert_eq!(v.buffer().len(), 48);
            assert_eq!(v.copy_to_host(stream).unwrap(), data);

            // A larger buffer is fine; a smaller one is not.
            let big = DeviceBuffer::zeroed(resource, 100, stream).unwrap();
            let v = StridedView::<f32>::contiguous(big.clone(), &[4, 3]).unwrap();
            assert_eq!(v.copy_to_host(stream).unwrap(), vec![0.0; 12]);
            assert_eq!(StridedView::<f32>::contiguous(big.clone(), &[5, 5]).unwrap().len(), 25);
            let err = StridedView::<f32>::contiguous(big, &[5, 6]).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::SizeMismatch {
                        expected: 120,
                        actual: 100,
                        ..
                    }
                ),
                "{err}"
            );
            let small = DeviceBuffer::zeroed(resource, 40, stream).unwrap();
            let err = StridedView::<f64>::contiguous(small.clone(), &[6]).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::SizeMismatch {
                        expected: 48,
                        actual: 40,
                        ..
                    }
                ),
                "{err}"
            );

            // Empty and 0-dimensional views.
            let e = StridedView::<i64>::contiguous(small.clone(), &[0, 7]).unwrap();
            assert!(e.is_empty() && e.is_contiguous());
            assert!(e.copy_to_host(stream).unwrap().is_empty());
            let scalar = StridedView::<i64>::from_host(&[-5], &[], resource, stream).unwrap();
            assert_eq!(scalar.len(), 1);
            assert_eq!(scalar.copy_to_host(stream).unwrap(), vec![-5]);

            // Half-precision elements.
            let halves: Vec<f16> = (0..10).map(|i| f16::from_f32(i as f32 / 4.0)).collect();
            let h = StridedView::from_host(&halves, &[2, 5], resource, stream).unwrap();
            assert_eq!(h.strides(), &[10, 2]);
            assert_eq!(h.copy_to_host(stream).unwrap(), halves);

            let wrong = StridedView::<u8>::from_host(&[1, 2, 3], &[2, 2], resource, stream).unwrap_err();
            assert!(matches!(wrong, Error::SizeMismatch { .. }), "{wrong}");
        }
    });
}

#[test]
fn strided_column_of_a_matrix() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            // A 4x3 matrix of i32: 1 2 3 / 4 5 6 / 7 8 9 / 10 11 12.
            let m: Vec<i32> = (1..=12).collect();
            let matrix = StridedView::from_host(&m, &[4, 3], resource, stream).unwrap();
            let buffer = matrix.buffer().clone();

            let column = StridedView::<i32>::with_layout(buffer.clone(), 4, &[4], &[12]).unwrap();
            assert!(!column.is_contiguous());
            assert_eq!(column.address(), buffer.address() + 4);
            assert_eq!(column.copy_to_host(stream).unwrap(), vec![2, 5, 8, 11]);
            let first = StridedView::<i32>::with_strides(buffer.clone(), &[4], &[12]).unwrap();
            assert_eq!(first.copy_to_host(stream).unwrap(), vec![1, 4, 7, 10]);
            // The transpose.
            let t = StridedView::<i32>::with_strides(buffer.clone(), &[3, 4], &[4, 12]).unwrap();
            assert_eq!(
                t.copy_to_host(stream).unwrap(),
                vec![1, 4, 7, 10, 2, 5, 8, 11, 3, 6, 9, 12]
            );
            // Rows repeated with a zero stride (read-only broadcast).
            let b = StridedView::<i32>::with_strides(buffer.clone(), &[3, 3], &[0, 4]).unwrap();
            assert_eq!(b.copy_to_host(stream).unwrap(), vec![1, 2, 3, 1, 2, 3, 1, 2, 3]);

            let bad = |r: arrow_cuda::Result<StridedView<i32>>| r.unwrap_err();
            assert!(matches!(
                bad(StridedView::with_strides(buffer.clone(), &[4], &[6])),
                Error::InvalidArgument(_)
            ));
            assert!(matches!(
                bad(StridedView::with_layout(buffer.clone(), 2, &[4], &[12])),
                Error::InvalidArgument(_)
            ));
            assert!(matches!(
                bad(StridedView::with_strides(buffer.clone(), &[4], &[-12])),
                Error::InvalidArgument(_)
            ));
            assert!(matches!(
                bad(StridedView::with_strides(buffer.clone(), &[4, 3], &[12])),
                Error::InvalidArgument(_)
            ));
            let err = bad(StridedView::with_layout(buffer.clone(), 4, &[5], &[12]));
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        offset: 4,
                        len: 52,
                        size: 48
                    }
                ),
                "{err}"
            );
            let err = bad(StridedView::with_strides(buffer.clone(), &[2, usize::MAX], &[4, 4]));
            assert!(
                matches!(err, Error::InvalidArgument(_) | Error::OutOfBounds { .. }),
                "{err}"
            );
            let err = bad(StridedView::with_strides(buffer.clone(), &[3], &[isize::MAX - 3]));
            assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
            drop((matrix, column, first, t, b));

            // Writing the column through the only view of the buffer.
            let mut column = StridedView::<i32>::with_layout(buffer, 4, &[4], &[12]).unwrap();
            column.copy_from_host(&[100, 200, 300, 400], stream).unwrap();
            let whole = StridedView::<i32>::contiguous(column.buffer().clone(), &[12]).unwrap();
            assert_eq!(
                whole.copy_to_host(stream).unwrap(),
                vec![1, 100, 3, 4, 200, 6, 7, 300, 9, 10, 400, 12]
            );
            drop(whole);
            let err = column.copy_from_host(&[1, 2, 3], stream).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::SizeMismatch {
                        expected: 16,
                        actual: 12,
                        ..
                    }
                ),
                "{err}"
            );

            // A broadcast view cannot be written.
            let mut b = StridedView::<i32>::with_strides(column.into_buffer(), &[3, 3], &[0, 4]).unwrap();
            let err = b.copy_from_host(&[0; 9], stream).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
    });
}

#[test]
fn split_and_slice_are_zero_copy() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            // 5x2 of u16.
            let m: Vec<u16> = (0..10).collect();
            let v = StridedView::from_host(&m, &[5, 2], resource, stream).unwrap();

            let rows = v.split(0, 2).unwrap();
            assert_eq!(rows.len(), 2);
            assert_eq!((rows[0].shape(), rows[1].shape()), (&[3, 2][..], &[2, 2][..]));
            assert_eq!(rows[0].copy_to_host(stream).unwrap(), vec![0, 1, 2, 3, 4, 5]);
            assert_eq!(rows[1].copy_to_host(stream).unwrap(), vec![6, 7, 8, 9]);
            assert!(
                rows.iter()
                    .all(|r| r.buffer().shares_allocation(v.buffer()) && r.is_contiguous())
            );
            assert_eq!(rows[1].address(), v.address() + 12);

            let cols = v.split(1, 2).unwrap();
            assert_eq!(cols[0].shape(), &[5, 1]);
            assert!(!cols[1].is_contiguous());
            assert_eq!(cols[1].copy_to_host(stream).unwrap(), vec![1, 3, 5, 7, 9]);

            let many = v.split(0, 7).unwrap();
            let lens: Vec<usize> = many.iter().map(|p| p.shape()[0]).collect();
            assert_eq!(lens, [1, 1, 1, 1, 1, 0, 0]);
            assert!(many[6].copy_to_host(stream).unwrap().is_empty());
            assert_eq!(many[4].copy_to_host(stream).unwrap(), vec![8, 9]);

            assert!(matches!(v.split(0, 0).unwrap_err(), Error::InvalidArgument(_)));
            assert!(matches!(v.split(2, 1).unwrap_err(), Error::InvalidArgument(_)));

            let s = v.slice(1, 3).unwrap();
            assert_eq!(s.shape(), &[3, 2]);
            assert_eq!(s.copy_to_host(stream).unwrap(), vec![2, 3, 4, 5, 6, 7]);
            assert_eq!(s.slice(2, 1).unwrap().copy_to_host(stream).unwrap(), vec![6, 7]);
            assert!(v.slice(5, 0).unwrap().is_empty());
            let err = v.slice(4, 2).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        offset: 16,
                        len: 8,
                        size: 20
                    }
                ),
                "{err}"
            );

            // Parts are read-only while their siblings live.
            let mut part = rows.into_iter().next().unwrap();
            let err = part.copy_from_host(&[0; 6], stream).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{err}");
        }
    });
}

#[test]
fn strided_copies_between_host_and_device() {
    common::each_device(|device, stream| {
        for &from in &with_host(device) {
            for &to in &with_host(device) {
                // A 6x5 matrix of f64; its block of rows 2..5 and columns 1..4.
                let m: Vec<f64> = (0..30).map(f64::from).collect();
                let matrix = StridedView::from_host(&m, &[6, 5], from, stream).unwrap();
                let block =
                    StridedView::<f64>::with_layout(matrix.buffer().clone(), (2 * 5 + 1) * 8, &[3, 3], &[40, 8])
                        .unwrap();
                let expected = vec![11.0, 12.0, 13.0, 16.0, 17.0, 18.0, 21.0, 22.0, 23.0];
                assert_eq!(block.copy_to_host(stream).unwrap(), expected);

                // Strided source into a contiguous destination on another resource.
                let mut dense = StridedView::<f64>::contiguous(zeroed(to, 72, stream), &[3, 3]).unwrap();
                block.copy_to(&mut dense, stream).unwrap();
                assert_eq!(dense.copy_to_host(stream).unwrap(), expected, "{from:?} -> {to:?}");
                assert_eq!(
                    block.to_contiguous(to, stream).unwrap().copy_to_host(stream).unwrap(),
                    expected
                );

                // Contiguous source into a strided destination: the block of a zeroed matrix.
                let target = zeroed(to, 240, stream);
                let mut into = StridedView::<f64>::with_layout(target, 88, &[3, 3], &[40, 8]).unwrap();
                dense.copy_to(&mut into, stream).unwrap();
                let whole = StridedView::<f64>::contiguous(into.buffer().clone(), &[30])
                    .unwrap()
                    .copy_to_host(stream)
                    .unwrap();
                let mut want = vec![0.0; 30];
                for (i, x) in [11, 12, 13, 16, 17, 18, 21, 22, 23].into_iter().enumerate() {
                    want[x] = expected[i];
                }
                assert_eq!(whole, want, "{from:?} -> {to:?}");
                drop(whole);

                // Column to column, both strided.
                let src_col = StridedView::<f64>::with_layout(matrix.buffer().clone(), 16, &[6], &[40]).unwrap();
                let mut dst_col = StridedView::<f64>::with_layout(zeroed(to, 6 * 24, stream), 8, &[6], &[24]).unwrap();
                src_col.copy_to(&mut dst_col, stream).unwrap();
                let got = StridedView::<f64>::contiguous(dst_col.buffer().clone(), &[6, 3])
                    .unwrap()
                    .copy_to_host(stream)
                    .unwrap();
                let col: Vec<f64> = got.chunks(3).map(|r| r[1]).collect();
                assert_eq!(col, vec![2.0, 7.0, 12.0, 17.0, 22.0, 27.0]);
                assert!(got.chunks(3).all(|r| r[0] == 0.0 && r[2] == 0.0));

                // Shapes must agree; a shared destination cannot be written.
                let mut other = StridedView::<f64>::contiguous(zeroed(to, 72, stream), &[9]).unwrap();
                assert!(matches!(
                    block.copy_to(&mut other, stream).unwrap_err(),
                    Error::InvalidArgument(_)
                ));
                let mut shared = StridedView::<f64>::contiguous(zeroed(to, 72, stream), &[3, 3]).unwrap();
                let _keep = shared.clone();
                assert!(matches!(
                    block.copy_to(&mut shared, stream).unwrap_err(),
                    Error::Unsupported(_)
                ));
            }
        }
    });
}

#[test]
fn three_dimensional_padded_copies() {
    common::each_device(|device, stream| {
        for resource in with_host(device) {
            // A 2x4x6 u32 array; view its [.., ..3, 1..5] part, every axis strided.
            let a: Vec<u32> = (0..48).collect();
            let full = StridedView::from_host(&a, &[2, 4, 6], resource, stream).unwrap();
            let part = StridedView::<u32>::with_layout(full.buffer().clone(), 4, &[2, 3, 4], &[96, 24, 4]).unwrap();
            let mut expected = Vec::new();
            for i in 0..2 {
                for j in 0..3 {
                    for k in 1..5 {
                        expected.push((i * 24 + j * 6 + k) as u32);
                    }
                }
            }
            assert_eq!(part.copy_to_host(stream).unwrap(), expected);

            // And write it back, transposed, into a fresh [4, 3, 2] array through permuted strides.
            let dst = zeroed(resource, 24 * 4, stream);
            let mut transposed = StridedView::<u32>::with_strides(dst, &[2, 3, 4], &[4, 8, 24]).unwrap();
            part.copy_to(&mut transposed, stream).unwrap();
            let back = StridedView::<u32>::contiguous(transposed.into_buffer(), &[4, 3, 2])
                .unwrap()
                .copy_to_host(stream)
                .unwrap();
            for i in 0..2 {
                for j in 0..3 {
                    for k in 0..4 {
                        assert_eq!(
                            back[k * 6 + j * 2 + i],
                            expected[i * 12 + j * 4 + k],
                            "{resource:?} [{i},{j},{k}]"
                        );
                    }
                }
            }
        }
    });
}

#[test]
fn async_view_copies_complete_by_their_event() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let m: Vec<i16> = (0..64).collect();
            let matrix = StridedView::from_host(&m, &[8, 8], resource, stream).unwrap();
            let diagonal_ish = StridedView::<i16>::with_strides(matrix.buffer().clone(), &[8, 2], &[16, 6]).unwrap();
            let mut out = vec![0i16; 16];
            // SAFETY: `out` is read only after the event completes; the views outlive it.
            let done = unsafe { diagonal_ish.copy_to_host_async(&mut out, stream) }.unwrap();
            done.synchronize().unwrap();
            let want: Vec<i16> = (0..8).flat_map(|r| [r * 8, r * 8 + 3]).collect();
            assert_eq!(out, want);

            let mut dense = StridedView::<i16>::zeroed(resource, &[8, 2], stream).unwrap();
            // SAFETY: both views stay alive and `dense` unread until the event completes.
            let done = unsafe { diagonal_ish.copy_to_async(&mut dense, stream) }.unwrap();
            done.synchronize().unwrap();
            assert_eq!(dense.copy_to_host(stream).unwrap(), want);

            let src: Vec<i16> = (100..116).collect();
            // SAFETY: `src` is unchanged and `dense` unread until the event completes.
            let done = unsafe { dense.copy_from_host_async(&src, stream) }.unwrap();
            done.synchronize().unwrap();
            assert_eq!(dense.copy_to_host(stream).unwrap(), src);
            let mut wrong = vec![0i16; 3];
            // SAFETY: the call fails before issuing anything.
            let err = unsafe { dense.copy_to_host_async(&mut wrong, stream) }.unwrap_err();
            assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
        }
    });
}

#[test]
fn views_show_their_element_and_layout_and_clones_share_the_buffer() {
    common::each_device(|device, stream| {
        for resource in resources(device) {
            let v = StridedView::<f32>::zeroed(resource, &[4, 3], stream).unwrap();
            let shown = format!("{v:?}");
            assert!(
                shown.starts_with("StridedView<f32>(shape [4, 3], strides [12, 4], offset 0 of "),
                "{shown}"
            );
            let h = StridedView::<f16>::zeroed(resource, &[2], stream).unwrap();
            assert!(format!("{h:?}").starts_with("StridedView<f16>("), "{h:?}");

            // A clone is the same view of the same allocation, which is read-only while both live.
            let copy = v.clone();
            assert_eq!(
                (copy.shape(), copy.strides(), copy.address()),
                (v.shape(), v.strides(), v.address())
            );
            assert!(copy.buffer().shares_allocation(v.buffer()));
            assert!(!v.buffer().is_mutable());
            drop(copy);
            assert!(v.buffer().is_mutable());
        }
    });
    assert_eq!(c_strides(&[2, 3, 4], 4), vec![48, 16, 4]);
    assert_eq!(c_strides(&[], 8), Vec::<isize>::new());
    assert_eq!((<f64 as Element>::NAME, <f16 as Element>::NAME), ("f64", "f16"));
}

/// Pinned host memory is not inherited by a child process, as `cuMemHostAlloc`'s is not: a fork
/// neither copies it into the child nor maps it there.
#[test]
fn pinned_memory_is_not_inherited_by_child_processes() {
    let Some(gpu) = common::cuda() else { return };
    let len = 4 << 20;
    let block = DeviceBuffer::alloc(MemoryResource::PinnedHost(gpu.ordinal().unwrap()), len, &Stream::cpu())
        .expect("pinned memory");
    let address = block.address() as usize;
    let mut pages = vec![0u8; len / 4096 + 1];
    // SAFETY: the child makes system calls only (mincore, _exit), which may follow a fork of a
    // process with other threads; `pages` was allocated before the fork.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above; `pages` has a byte for every page of the range.
        let mapped = unsafe { libc::mincore(address as *mut libc::c_void, len, pages.as_mut_ptr()) } == 0;
        // SAFETY: ends the child without running anything of the parent's.
        unsafe { libc::_exit(if mapped { 1 } else { 0 }) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: waits for the child just made.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child had the parent's pinned memory mapped (status {status})"
    );
    drop(block);
}
